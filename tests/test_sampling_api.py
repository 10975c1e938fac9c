"""Sampled captions (Photo.sample, Captioner.sample, captioner-caption --sample): seeded, drawn only from the
top-k set and the nucleus of the step's scores, greedy at their limits (top_k 1, tiny top_p, temperature -> 0),
dressed like a caption (maps summing to 1, the model's own word log-probs), arguments checked."""
from __future__ import annotations

import argparse
import inspect
import json

import numpy as np
import pytest
import torch

import captioner
from captioner.cli.caption import main
from captioner.decoding.rules import photo_evidence
from captioner.decoding.rules import Lexicon
from captioner.decoding.sampling import Draw
from captioner.vocab import SpecialIds, is_salad

from .rules_oracle import word_logp

EXAMPLES = sorted((captioner.DEFAULT_CHECKPOINT.parent / "examples").glob("*.jpg"))


@pytest.fixture(scope="module")
def photos(bundled) -> list:
    return bundled.read_batch([str(p) for p in EXAMPLES])


def step_scores(model: captioner.Captioner, photo, words: list[str], **overrides) -> torch.Tensor:
    """The scores each word of a sampled caption was drawn from (the decode rules applied, written literally:
    tests/rules_oracle.py),
    recomputed by stepping the decoder along its words: (L + 1, V), the last row <end>'s step."""
    settings = model.decode_settings(**overrides)
    ids = SpecialIds.of(model.vocab, settings.forbid_unk)
    evidence = photo_evidence(photo.reading, model.model, model.vocab, settings) if settings.evidence else None
    dec, feats = model.model.decoder, photo.features  # (1, P, D)
    feat_proj, state = dec.attention.project(feats), dec.init_state(feats)
    tokens = [model.vocab.stoi[w] for w in words]
    prev, rows = torch.tensor([ids.start]), []
    with torch.no_grad():
        for t in range(len(tokens) + 1):
            emb, emb_gates = dec.embed(prev)
            logits, _, _, state = dec.step(state, emb, emb_gates, feats, feat_proj, settings.hard_context)
            rows.append(word_logp(logits, ids, settings, torch.tensor([tokens[:t]], dtype=torch.long), evidence,
                                  torch.zeros(1, dtype=torch.long), Lexicon.of(model.vocab))[0])
            prev = torch.tensor(tokens[t:t + 1] or [ids.end])
    return torch.stack(rows)  # (L + 1, V)


def drawn_ids(model, cap) -> list[int]:
    """The ids drawn at each step: the words, then <end> unless the caption was capped at max_len."""
    ids = [model.vocab.stoi[w] for w in cap.words]
    return ids + ([model.vocab.end] if len(ids) < cap.settings["max_len"] else [])


def test_same_seed_same_captions_and_the_global_random_state_is_untouched(bundled, photos):
    numpy_args = photos[0].sample(n=np.int64(2), temperature=np.float64(0.9), top_k=np.int64(5), seed=np.int64(4))
    assert [c.words for c in numpy_args] == [c.words for c in photos[0].sample(2, 0.9, 5, seed=4)]
    json.dumps(numpy_args[0].to_dict())  # numpy's numbers recorded as plain ones
    before = torch.get_rng_state()
    for photo in photos:
        a, b = photo.sample(n=4, seed=7), photo.sample(n=4, seed=7)
        assert [c.words for c in a] == [c.words for c in b]
        assert [c.log_prob for c in a] == pytest.approx([c.log_prob for c in b])
    assert torch.equal(torch.get_rng_state(), before)
    again = bundled.sample(str(EXAMPLES[0]), n=4, seed=7)  # read again: the same photo, the same draws
    assert [c.words for c in again] == [c.words for c in photos[0].sample(n=4, seed=7)]


def test_different_seeds_differ_on_some_photo_and_a_fresh_seed_is_recorded(photos):
    texts = lambda photo, seed: [c.text for c in photo.sample(n=4, seed=seed)]  # noqa: E731
    assert any(texts(p, 0) != texts(p, 1) for p in photos)
    fresh = photos[0].sample(n=3)
    seed = fresh[0].settings["sample"]["seed"]
    assert isinstance(seed, int) and [c.settings["sample"]["index"] for c in fresh] == [0, 1, 2]
    assert [c.text for c in photos[0].sample(n=3, seed=seed)] == [c.text for c in fresh]


@pytest.mark.parametrize("limit", [{"top_k": 1}, {"top_p": 1e-6}, {"temperature": 1e-4}],
                         ids=["top_k=1", "tiny top_p", "temperature->0"])
def test_the_limits_of_sampling_are_greedy_decoding(photos, limit):
    for photo in photos:
        greedy = photo.caption(beam_size=1)
        for cap in photo.sample(n=3, seed=0, **limit):
            assert cap.words == greedy.words
            assert cap.log_prob == pytest.approx(greedy.log_prob, abs=1e-4)
            assert np.allclose(cap.word_log_probs, greedy.word_log_probs, atol=1e-4)
            assert np.allclose(cap.alphas, greedy.alphas, atol=1e-5)


def test_a_lower_temperature_draws_the_greedy_caption_more_often(photos):
    photo = photos[0]
    greedy = photo.caption(beam_size=1).words
    share = {t: np.mean([c.words == greedy for c in photo.sample(n=20, temperature=t, seed=0)]) for t in (1.5, 0.05)}
    assert share[0.05] > share[1.5]


def test_the_default_samples_read_as_captions_where_the_models_own_distribution_is_salad(photos):
    """At temperature 1 and no cut a fifth of the bundled model's samples held a word it gives under 1% ("a bird is
    standing in front of a celebrate gnawing around her leaves"). The defaults (0.6, top_p 0.9; the API's and the
    command's alike): of 20 samples of each photo none is word salad by the repeat rules (vocab.is_salad) and none
    averages below exp(-3.5) per word, a bound each photo's samples break at temperature 1 with no cut."""
    from captioner.cli.sample_options import add_sample_options, sample_request

    for fn in (captioner.Captioner.sample, captioner.Photo.sample):
        params = inspect.signature(fn).parameters
        assert (params["temperature"].default, params["top_p"].default) == (0.6, 0.9)
    parser = argparse.ArgumentParser()
    add_sample_options(parser)
    cli = sample_request(argparse.Namespace(**vars(parser.parse_args(["--sample", "20"])), explain=None))
    assert (cli.draw.temperature, cli.draw.top_k, cli.draw.top_p) == (0.6, 0, 0.9)
    mean_logp = lambda cap: float(np.mean(cap.word_log_probs))  # noqa: E731
    for photo in photos[:2]:
        drawn = photo.sample(n=20, seed=0)
        assert not [c.text for c in drawn if is_salad(c.words)]
        assert not [c.text for c in drawn if mean_logp(c) < -3.5]
        assert len({c.text for c in drawn}) > 1  # still drawn, not the greedy caption 20 times
        assert any(mean_logp(c) < -3.5 for c in photo.sample(n=20, temperature=1.0, top_p=1.0, seed=0))


@pytest.mark.parametrize("draw", [dict(top_k=3), dict(top_p=0.5, temperature=0.7), dict(top_k=5, top_p=0.8, temperature=1.5)])
def test_every_sampled_word_lies_in_the_top_k_set_and_the_nucleus_of_its_step(bundled, photos, draw):
    for photo in photos:
        for cap in photo.sample(n=4, seed=1, **draw):
            scores = step_scores(bundled, photo, cap.words)  # (L + 1, V)
            for row, w in zip(scores, drawn_ids(bundled, cap)):
                if draw.get("top_k"):
                    assert int((row > row[w]).sum()) < draw["top_k"]  # fewer than k words score higher
                if draw.get("top_p"):
                    p = torch.softmax(row / draw.get("temperature", 1.0), 0)
                    assert float(p[p > p[w]].sum()) < draw["top_p"]  # the more likely words hold less than top_p


def test_samples_are_dressed_like_captions_with_the_models_own_log_probs(bundled, photos):
    for photo in photos:
        for cap in photo.sample(n=3, seed=2, temperature=1.2):
            L, g = len(cap.words), bundled.grid_size
            assert cap.words and cap.text == " ".join(cap.words) and not {"<pad>", "<start>", "<end>", "<unk>"} & set(cap.words)
            assert cap.alphas.shape == (L, g, g) and np.allclose(cap.alphas.reshape(L, -1).sum(1), 1, atol=1e-5)
            assert len(cap.betas) == L and ((cap.betas >= 0) & (cap.betas <= 1)).all()
            assert cap.concepts == photo.concepts.top and cap.model_file == bundled.source and cap.score is None
            assert cap.settings["sample"]["temperature"] == 1.2
            assert cap.settings["beam_size"] == bundled.config.decode.beam_size
            # the model's own probabilities of these words (the evidence's bias taken off), as teacher forcing gives them
            forced = photo.explain(cap.text)
            assert np.allclose(cap.word_log_probs, forced.word_log_probs, atol=1e-4)
            if L < cap.settings["max_len"]:  # ended with <end>: the sentence's log-prob too
                assert cap.log_prob == pytest.approx(forced.log_prob, abs=1e-3)
            json.dumps(cap.to_dict("x.jpg"))


def test_the_evidence_veto_and_the_decode_rules_hold_for_samples(photos):
    for photo in photos:
        for cap in photo.sample(n=8, seed=3, temperature=1.5, evidence=True, block_repeats=True):
            assert not cap.contradicted  # no word naming what the heads rule out
            assert all(a != b for a, b in zip(cap.words, cap.words[1:]))  # no word twice back to back


def test_draw_keeps_exactly_the_top_k_and_the_smallest_nucleus():
    gen = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(50, 30, generator=gen) * 2, 1)  # (N, V), no ties
    assert torch.allclose(Draw().probs(logp), logp.exp())
    for k in (1, 4, 30):
        kept = Draw(top_k=k).probs(logp) > 0
        assert (kept.sum(1) == k).all() and torch.equal(kept, logp >= logp.topk(k, 1).values[:, -1:])
    for p in (1e-6, 0.3, 0.9):
        probs = Draw(top_p=p).probs(logp)
        assert torch.allclose(probs.sum(1), torch.ones(50))
        for row, keep in zip(logp.exp(), probs > 0):
            mass = row.sort(descending=True).values.cumsum(0)
            assert int(keep.sum()) == int((mass < p).sum()) + 1  # the fewest best words holding p
            assert row[keep].min() >= row[~keep].max() if (~keep).any() else True
    hot, cold = Draw(temperature=2.0).probs(logp), Draw(temperature=0.5).probs(logp)
    entropy = lambda q: -(q * q.clamp_min(1e-30).log()).sum(1)  # noqa: E731
    assert (entropy(hot) > entropy(logp.exp())).all() and (entropy(cold) < entropy(logp.exp())).all()


@pytest.mark.parametrize("bad, says", [
    (dict(temperature=0), "temperature must be a number above 0"), (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("inf")), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0), r"top_p must lie in \(0, 1\]"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k must be a whole number >= 0"), (dict(top_k=2.5), "top_k"),
    (dict(n=0), "n must be a whole number >= 1"), (dict(n=True), "n must"),
    (dict(seed=-3), "seed must be a whole number >= 0"), (dict(seed=1.5), "seed must")])
def test_invalid_arguments_are_value_errors_that_say_what_is_allowed(bundled, photos, bad, says):
    with pytest.raises(ValueError, match=says):
        photos[0].sample(**bad)
    with pytest.raises(ValueError, match=says):  # before the image is read: no ImageError for a missing file
        bundled.sample("no/such/photo.jpg", **bad)


@pytest.mark.slow
def test_the_cli_samples_the_example_photos_end_to_end(bundled, capsys, tmp_path):
    paths = [str(p) for p in EXAMPLES]
    args = [*paths, "--sample", "3", "--seed", "5", "--top-p", "0.9", "--temperature", "0.8", "--json"]
    assert main(args) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["image"] for r in lines] == [p for p in paths for _ in range(3)]
    assert all(r["settings"]["sample"] == {"n": 3, "temperature": 0.8, "top_k": 0, "top_p": 0.9, "seed": 5,
                                           "index": i % 3} for i, r in enumerate(lines))
    assert all(r["caption"] == " ".join(r["words"]) and len(r["word_log_probs"]) == len(r["words"]) for r in lines)
    assert main(args) == 0  # the same seed: the same captions
    assert [json.loads(x)["caption"] for x in capsys.readouterr().out.splitlines()] == [r["caption"] for r in lines]
    photo = bundled.read(paths[1])  # each photo sampled on its own: the API's captions
    assert [c.text for c in photo.sample(3, 0.8, 0, 0.9, 5)] == [r["caption"] for r in lines[3:6]]
    assert main([paths[0], "--sample", "2", "--seed", "1", "--attention-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out.splitlines()
    assert [line.split("\t")[1] for line in text] == ["sample 1", "sample 2"]
    assert sorted(p.name for p in tmp_path.glob("*.png")) == [f"{EXAMPLES[0].stem}_sample{i}_attention.png" for i in (1, 2)]


@pytest.mark.parametrize("bad, says", [(["--top-k", "-2"], "--top-k must be"), (["--temperature", "0"], "--temperature must"),
                                       (["--explain", "a cat"], "use one of them")])
def test_the_cli_refuses_bad_sampling_options_before_any_work(capsys, bad, says):
    assert main([str(EXAMPLES[0]), "--sample", "2", *bad]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("given", [["--top-k", "1"], ["--top-p", "0.5"], ["--temperature", "0.7", "--seed", "3"]])
def test_drawing_options_without_sample_are_refused_in_one_line(capsys, given):
    """`--top-k 1` without --sample was ignored in silence: the caption was decoded as if it were not there."""
    assert main([str(EXAMPLES[0]), *given]) == 2
    err = capsys.readouterr()
    assert err.out == "" and len(err.err.splitlines()) == 1
    verb = "apply" if given.count("--seed") else "applies"  # one option applies, two apply
    assert err.err.startswith(f"error: {given[0]}") and f"only {verb} with --sample N" in err.err


def test_the_settings_line_while_sampling_names_the_sampling_settings_not_the_beam(capsys):
    assert main([str(EXAMPLES[0]), "--sample", "1", "--seed", "0"]) == 0
    line = capsys.readouterr().err.splitlines()[0]
    assert line.startswith("sampling 1 caption(s) per image (temperature 0.6, top_k 0, top_p 0.9, seed 0)")
    assert "max_len" in line and not any(k in line for k in ("beam_size", "length_penalty", "consensus"))
