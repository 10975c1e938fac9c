"""The concept language model: its vocabulary keeps the captioner's ids, its decoding API (start /
step / select) agrees with teacher forcing and reorders rows exactly, files round-trip without
pickle, fusion conserves the captioner's <unk> mass, and the concept condition steers the words."""
from __future__ import annotations

import json
import math

import pytest
import torch

from captioner.api import DEFAULT_CHECKPOINT
from captioner.checkpoint import CheckpointError
from captioner.lm.model import (ConceptLM, LMConfig, captioner_input_ids, extend_vocab, fuse_scores, generate,
                                      load_language_model, save_language_model)
from captioner.lm.data import CATEGORIES, batches, coco_captions, corrupt_concepts, encode, named_concepts, observable_mask
from captioner.vocab import SPECIALS, Vocab

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BASE = Vocab(list(SPECIALS) + "a dog runs on the grass plate".split())  # the "captioner's" vocabulary, V = 11
SENTENCES = [("a pizza on a plate", ["pizza"]), ("a dog runs on the grass", ["dog"])] * 5
CATS = ["pizza", "dog", "person"]


def tiny_lm(vocab: Vocab | None = None, categories=CATS, dropout: float = 0.0) -> ConceptLM:
    vocab = vocab or extend_vocab(BASE, [s.split() for s, _ in SENTENCES], min_count=5)
    return ConceptLM(LMConfig(len(vocab), len(BASE), len(categories), 16, 32, 1, dropout), vocab, categories)


def test_extended_vocab_keeps_captioner_ids_and_adds_frequent_new_words():
    sents = [["a", "giraffe"]] * 6 + [["a", "zebra", "pizza"]] * 5 + [["a", "okapi"]] * 4
    v = extend_vocab(BASE, sents, min_count=5)
    assert v.itos[:len(BASE)] == BASE.itos  # same ids for every captioner word
    assert v.itos[len(BASE):] == ["giraffe", "pizza", "zebra"]  # by count, then alphabetically; okapi too rare
    assert tiny_lm(v).vocab.stoi["dog"] == BASE.stoi["dog"]


def test_first_loss_of_an_untrained_model_is_about_log_vocab():
    lm, cats = tiny_lm(), torch.rand(10, 3)
    data = encode([s.split() for s, _ in SENTENCES], lm.vocab, CATS)
    inputs, targets, _ = next(batches(data, 10))
    with torch.no_grad():
        nll, n = lm.nll(inputs, targets, cats)
    assert abs(float(nll) / n - math.log(len(lm.vocab))) < 0.3


def test_step_equals_teacher_forcing_and_select_reorders_rows_exactly():
    lm = tiny_lm().eval()
    X, N = len(lm.vocab), 4
    concepts, words = torch.rand(N, 3), torch.randint(4, X, (N, 5))  # (N, C), (N, T)
    words[:, 0] = lm.vocab.start
    forced = torch.log_softmax(lm(words, concepts), -1)  # (N, T, X)
    state = lm.start(concepts)
    for t in range(5):
        logp, state = lm.step(state, words[:, t])
        assert logp.shape == (N, X)
        torch.testing.assert_close(logp, forced[:, t], atol=1e-5, rtol=1e-5)
    assert [tuple(s.shape) for s in state] == [(N, 1, 32), (N, 1, 32), (N, 3)]  # rows first
    rows = torch.tensor([2, 0, 2])
    picked = lm.select(state, rows)
    next_words = torch.tensor([5, 6, 7])
    logp_sel, _ = lm.step(picked, next_words)
    logp_all, _ = lm.step(state, next_words.new_tensor([6, 5, 5, 5]))  # row 0 reads 6, row 2 reads 5 and 7
    torch.testing.assert_close(logp_sel[1], logp_all[0], atol=0, rtol=0)
    torch.testing.assert_close(logp_sel[0], lm.step(lm.select(state, torch.tensor([2])), torch.tensor([5]))[0][0],
                               atol=0, rtol=0)
    assert torch.equal(picked[2], concepts[rows])


def test_save_load_round_trip_gives_identical_log_probs(tmp_path):
    lm = tiny_lm().eval()
    concepts, words = torch.rand(3, 3), torch.tensor([1, 1, 1])
    for half, tol in ((False, 0.0), (True, 2e-2)):
        save_language_model(lm, tmp_path / "lm.safetensors", half=half)
        back = load_language_model(tmp_path / "lm.safetensors")
        assert back.vocab.itos == lm.vocab.itos and back.categories == CATS and back.config == lm.config
        want = lm.step(lm.start(concepts), words)[0]
        torch.testing.assert_close(back.step(back.start(concepts), words)[0], want, atol=tol, rtol=0)


def test_loading_a_wrong_file_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="captioner checkpoint, not a language model"):
        load_language_model(DEFAULT_CHECKPOINT)
    torch.save({"x": torch.zeros(1)}, tmp_path / "lm.pt")
    with pytest.raises(CheckpointError, match="pickle"):
        load_language_model(tmp_path / "lm.pt")
    with pytest.raises(CheckpointError, match="not found"):
        load_language_model(tmp_path / "missing.safetensors")


def test_fusion_with_weight_zero_and_no_new_words_is_the_captioner():
    cap = torch.log_softmax(torch.randn(4, 11), -1)  # (N, V)
    lm = torch.log_softmax(torch.randn(4, 11), -1)  # (N, X = V)
    fused = fuse_scores(cap, lm, 0.0, unk=3)
    assert fused.shape == (4, 11) and torch.isneginf(fused[:, 3]).all()  # <unk> forbidden
    keep = [i for i in range(11) if i != 3]
    torch.testing.assert_close(fused[:, keep], cap[:, keep], atol=0, rtol=0)
    torch.testing.assert_close(fuse_scores(cap, lm, 0.5, 3)[:, keep], (cap + 0.5 * lm)[:, keep])


def test_fusion_gives_the_new_words_exactly_the_captioners_unk_mass():
    V, X = 11, 15
    cap = torch.log_softmax(torch.randn(4, V), -1)
    lm = torch.log_softmax(torch.randn(4, X) * 3, -1)
    fused = fuse_scores(cap, lm, 0.0, unk=3)  # (N, X)
    assert fused.shape == (4, X)
    torch.testing.assert_close(fused[:, V:].exp().sum(-1), cap[:, 3].exp())  # mass conservation
    torch.testing.assert_close(fused.exp().sum(-1), torch.ones(4))  # a distribution over X at weight 0
    ratio = (fused[:, V:] - lm[:, V:])  # the new words keep the LM's proportions
    torch.testing.assert_close(ratio, ratio[:, :1].expand_as(ratio))
    weighted = fuse_scores(cap, lm, 0.7, unk=3)
    torch.testing.assert_close(weighted[:, V:] - fused[:, V:], 0.7 * lm[:, V:])
    with pytest.raises(ValueError):
        fuse_scores(cap, lm[:, :V - 1], 0.0, unk=3)


def test_captioner_input_ids_map_new_words_to_unk():
    ids = torch.tensor([[0, 4, 10, 11], [14, 3, 2, 1]])
    assert captioner_input_ids(ids, 11, unk=3).tolist() == [[0, 4, 10, 3], [3, 3, 2, 1]]


def test_named_concepts_match_the_grounding_rule_and_never_name_person():
    sents = [["a", "man", "eats", "pizza"], ["a", "hot", "dog", "and", "a", "puppy"], ["two", "people"]]
    named = named_concepts(sents)  # (S, C) over list(CATEGORY_WORDS)
    col = CATEGORIES.index
    assert named.shape == (3, len(CATEGORIES)) and float(named[:, col("person")].sum()) == 0
    assert named[0].nonzero().flatten().tolist() == [col("pizza")]
    assert sorted(named[1].nonzero().flatten().tolist()) == sorted([col("hot dog"), col("dog")])
    assert float(named[2].sum()) == 0


def test_corrupted_concepts_drop_soften_add_low_distractors_and_skip_person():
    named = torch.zeros(4000, len(CATEGORIES))
    named[:, CATEGORIES.index("pizza")] = 1
    gen = torch.Generator().manual_seed(0)
    noisy = corrupt_concepts(named, observable_mask(), drop=0.3, distractors=2.0, low=0.3, generator=gen)
    pizza = noisy[:, CATEGORIES.index("pizza")]
    assert abs(float((pizza == 0).float().mean()) - 0.3) < 0.03  # dropped
    assert float(pizza[pizza > 0].min()) >= 0.3 and float(pizza.max()) <= 1  # kept at a soft value
    others = torch.cat([noisy[:, :CATEGORIES.index("pizza")], noisy[:, CATEGORIES.index("pizza") + 1:]], 1)
    assert float(others.max()) <= 0.3 and abs(float((others > 0).float().sum(1).mean()) - 2.0) < 0.2
    assert float(noisy[:, CATEGORIES.index("person")].abs().sum()) == 0


def test_coco_holdout_keeps_the_captions_of_an_image_together(tmp_path):
    anns = [{"image_id": i, "caption": f"photo {i} caption {k}"} for i in range(40) for k in range(5)]
    path = tmp_path / "captions.json"
    path.write_text(json.dumps({"images": [], "annotations": anns}))
    train, val = coco_captions(path, holdout=0.05)
    assert len(val) == 10 and len(train) == 190  # 2 of 40 images, 5 captions each
    val_images = {c.split()[1] for c in val}
    assert not any(c.split()[1] in val_images for c in train)


def test_the_concept_condition_steers_the_next_word():
    """A tiny LM trained on "a pizza on a plate" {pizza} and "a dog runs on the grass" {dog} must
    prefer "pizza" after "a" given {pizza} and "dog" given {dog}: only the condition tells them apart."""
    torch.manual_seed(0)
    lm = tiny_lm()
    v = lm.vocab
    data = encode([s.split() for s, _ in SENTENCES], v, CATS)
    data.concepts = torch.stack([torch.tensor([float(c in names) for c in CATS]) for _, names in SENTENCES])
    opt = torch.optim.Adam(lm.parameters(), lr=1e-2)
    for _ in range(150):
        for inputs, targets, concepts in batches(data, 10):
            nll, n = lm.nll(inputs, targets, concepts)
            opt.zero_grad()
            (nll / n).backward()
            opt.step()
    lm.eval()
    for name, other in (("pizza", "dog"), ("dog", "pizza")):
        cond = torch.tensor([[float(c == name) for c in CATS]])
        with torch.no_grad():
            _, state = lm.step(lm.start(cond), torch.tensor([v.start]))
            logp, _ = lm.step(state, torch.tensor([v.stoi["a"]]))
        assert float(logp[0, v.stoi[name]]) > math.log(0.9) > float(logp[0, v.stoi[other]])
        assert generate(lm, cond)[0][:2] == ["a", name]


def test_fit_saves_the_best_model_and_the_cli_describes_it(tmp_path, capsys):
    from captioner.cli.train_lm import main
    from captioner.lm.data import Corpus
    from captioner.lm.train import LMTrainSettings, build_lm, fit

    vocab = extend_vocab(BASE, [s.split() for s, _ in SENTENCES], min_count=5)
    data = encode([s.split() for s, _ in SENTENCES], vocab)  # real categories: pizza and dog are named
    corpus = Corpus(vocab, data, data, {"train": len(data)})
    s = LMTrainSettings(embed_dim=16, hidden_dim=32, epochs=3, batch_size=4, lr=1e-2, log_every=1000, half=True)
    lm = build_lm(corpus, len(BASE), CATEGORIES, s)
    best = fit(lm, corpus, s, tmp_path / "lm.safetensors", log=lambda line: None)
    assert best["epoch"] >= 2 and best["val_ppl"] < len(vocab)  # it learnt something
    assert main(["--describe", str(tmp_path / "lm.safetensors")]) == 0
    out = capsys.readouterr().out
    assert all(f"{{{name}}}  greedy:" in out for name in ("pizza", "giraffe", "zebra", "")), out
    assert "log p(pizza | <start> a, {pizza})" in out
