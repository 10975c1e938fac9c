"""Self-critical training: sampling is consistent with teacher forcing, the mean-of-others baseline
gives advantages that sum to zero per image, bad endings are penalised when asked, and SCST raises
the CIDEr-D of a tiny model's samples."""
from __future__ import annotations

import pytest
import torch

from captioner.decoding.cider import CiderD
from captioner.config import Config
from captioner.data.dataset import collate
from captioner.vocab import SpecialIds
from captioner.decoding.sampling import sample
from captioner.model.show_attend_tell import ShowAttendTell
from captioner.training.objectives import SelfCritical, batch_references, mean_of_others
from captioner.vocab import Vocab

from .conftest import optimise, tiny_decoder

B, P, D, V = 3, 9, 16, 12
PAD, START, END, UNK = 0, 1, 2, 3
IDS = SpecialIds(START, END, PAD)


def test_samples_are_well_formed_and_their_log_probs_match_teacher_forcing():
    dec = tiny_decoder(V).eval()
    feats = torch.randn(B, P, D)
    K = 4
    s = sample(dec, feats, SpecialIds(START, END, PAD, UNK), n_samples=K, max_len=8)
    N, T = s.tokens.shape
    assert N == B * K and s.log_probs.shape == (N, T) and s.alphas.shape == (N, T, P)
    for row, mask in zip(s.tokens.tolist(), s.mask.tolist()):
        n = sum(mask)
        assert mask == [True] * n + [False] * (T - n)  # real tokens, then nothing
        assert all(w not in (PAD, START, UNK) for w in row[:n])
        assert END not in row[:n - 1] and all(w == PAD for w in row[n:])
    assert torch.allclose(s.alphas.sum(-1), s.mask.float(), atol=1e-5)  # a distribution per real token
    # the sampled tokens' log-probs are the teacher-forced model's, renormalised without the banned words
    order = s.mask.sum(1).argsort(descending=True)
    lengths = s.mask.sum(1)[order]
    inputs = torch.cat([torch.full((N, 1), START), s.tokens[:, :-1]], 1)[order]
    logits = dec.teacher_force(feats, inputs, lengths, (torch.arange(N) // K)[order]).logits
    logits[..., [PAD, START, UNK]] = float("-inf")
    picked = torch.log_softmax(logits, -1).gather(2, s.tokens[order].unsqueeze(2)).squeeze(2)
    want = torch.where(s.mask[order], picked, torch.zeros_like(picked))
    assert torch.allclose(s.log_probs[order], want, atol=1e-5)


def test_sampling_is_differentiable():
    dec = tiny_decoder(V, dropout=0.5).train()
    s = sample(dec, torch.randn(B, P, D), IDS, n_samples=3, max_len=6)
    s.log_probs.sum().backward()  # dead rows hold -inf log-probs for <pad> internally: no NaN may leak
    for name in ("out_vocab.weight", "embedding.weight", "gates_hidden.weight", "attention.feat_proj.weight"):
        g = dec.get_parameter(name).grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, name


def _setup(objective_cfg: dict, refs_per_image):
    cfg = Config()
    cfg.train.objective = "scst"
    for k, v in objective_cfg.items():
        setattr(cfg.train, k, v)
    vocab = Vocab(["<pad>", "<start>", "<end>", "<unk>"] + [f"w{i}" for i in range(V - 5)] + ["a"])
    cider = CiderD([[r] for r in refs_per_image] + [[[i, i + 1]] for i in range(4, V - 1)])
    return cfg, vocab, cider


def _batch(feats, refs_per_image):
    return collate([(f, [[START] + r + [END]]) for f, r in zip(feats, refs_per_image)])


def test_mean_of_others_baseline_advantages_sum_to_zero_per_image():
    refs = [[4, 5, 6, 7], [8, 9, 4], [5, 5, 6]]
    cfg, vocab, cider = _setup({"scst_samples": 5, "scst_max_len": 6}, refs)
    obj = SelfCritical(cfg, vocab, cider)
    batch = _batch(torch.randn(B, P, D), refs)
    assert batch_references(batch, END) == [[r] for r in refs]
    r = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [0.0, 0.0, 4.0, 0.0, 0.0]])
    want = torch.tensor([[14 / 4, 13 / 4, 12 / 4, 11 / 4, 10 / 4], [1.0, 1.0, 0.0, 1.0, 1.0]])  # by hand
    assert torch.allclose(mean_of_others(r), want)
    assert torch.allclose((r - mean_of_others(r)).sum(1), torch.zeros(2))
    terms = obj(ShowAttendTell(torch.nn.Identity(), tiny_decoder(V)), batch)  # type: ignore[arg-type]
    assert torch.isfinite(terms.total) and set(terms.logs) >= {"reward", "baseline", "penalty"}
    assert terms.logs["reward"] == pytest.approx(terms.logs["baseline"], abs=1e-6)  # mean of others: same mean
    cfg.train.scst_xent = 0.5  # mixed objective: the references' cross-entropy is added and logged
    mixed = obj(ShowAttendTell(torch.nn.Identity(), tiny_decoder(V)), batch)  # type: ignore[arg-type]
    assert mixed.logs["xent"] > 0 and torch.isfinite(mixed.total)


def test_bad_ending_penalty():
    refs = [[4, 5, 6]]
    cfg, vocab, cider = _setup({"scst_bad_ending_penalty": 0.5}, refs)
    obj = SelfCritical(cfg, vocab, cider)
    a = vocab.stoi["a"]
    plain = SelfCritical(_setup({}, refs)[0], vocab, cider)
    r_pen = obj.rewards([[4, 5, a], [4, 5, 6]], [[refs[0]]] * 2)
    r_raw = plain.rewards([[4, 5, a], [4, 5, 6]], [[refs[0]]] * 2)
    assert r_pen[0] == pytest.approx(r_raw[0] - 0.5) and r_pen[1] == pytest.approx(r_raw[1])


@pytest.mark.slow
@pytest.mark.parametrize("baseline", ["mean", "greedy"])
def test_self_critical_training_raises_the_reward(baseline):
    torch.manual_seed(0)
    refs = [[4, 5, 6, 7], [8, 9, 4, 5], [6, 7, 8, 9]]
    cfg, vocab, cider = _setup({"scst_samples": 5, "scst_max_len": 6, "scst_baseline": baseline,
                                "alpha_c": 0.0}, refs)
    model = ShowAttendTell(torch.nn.Identity(), tiny_decoder(V))  # type: ignore[arg-type]
    obj = SelfCritical(cfg, vocab, cider)
    batch = _batch(torch.randn(B, P, D), refs)
    rewards = [r["reward"] for r in optimise(obj, model, batch, steps=120, lr=2e-2)]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > max(2 * first, first + 1.0), (first, last)  # CIDEr-D of samples; 10 is perfect


def test_reward_can_count_the_end_token():
    """With train.scst_reward_end, a caption cut off before the reference's last word loses the
    final n-grams that include <end>; a complete one keeps the maximum."""
    refs = [[4, 5, 6, 7]]
    cfg, vocab, cider = _setup({"scst_reward_end": True}, refs)
    cider_end = CiderD([[r + [END]] for r in refs] + [[[i, i + 1, END]] for i in range(4, V - 1)])
    with_end = SelfCritical(cfg, vocab, cider_end)
    plain = SelfCritical(_setup({}, refs)[0], vocab, cider)
    full, cut = [4, 5, 6, 7], [4, 5, 6]
    assert with_end.rewards([full], [refs])[0] == pytest.approx(10.0)
    gap_end = with_end.rewards([full], [refs])[0] - with_end.rewards([cut], [refs])[0]
    gap_plain = plain.rewards([full], [refs])[0] - plain.rewards([cut], [refs])[0]
    assert gap_end > gap_plain > 0


def test_configuration_errors_are_clear():
    refs = [[4, 5, 6]]
    for bad, match in (({"scst_baseline": "median"}, "scst_baseline must be one of mean, greedy"), ({"scst_samples": 1}, "scst_samples >= 2"),
                       ({"cpu_amp": True}, "cpu_amp=false")):
        cfg, vocab, cider = _setup(bad, refs)
        with pytest.raises(ValueError, match=match):
            SelfCritical(cfg, vocab, cider)
