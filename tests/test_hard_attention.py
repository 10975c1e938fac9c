"""Hard (stochastic) attention, Xu et al. 2015 section 4.1: the sampled context is the gated
annotation at the sampled location, locations are drawn from alpha, the expected mode is exactly the
soft model, REINFORCE is what trains the attention scores, the moving-average baseline survives a
checkpoint, and a tiny hard model learns (random tensors, no data needed)."""
from __future__ import annotations

import pytest
import torch

from captioner.checkpoint import load_checkpoint, load_model_state, save_checkpoint
from captioner.config import Config, load_config
from captioner.data.dataset import collate
from captioner.config import DecodeConfig
from captioner.decoding.search import beam_search, decode
from captioner.vocab import SpecialIds
from captioner.training.loss import caption_log_likelihood, caption_loss, hard_attention_terms, update_baseline
from captioner.model.attention import locate
from captioner.model.show_attend_tell import ShowAttendTell
from captioner.model.decoder import Decoder
from captioner.training.objectives import CrossEntropy
from captioner.decoding.sampling import sample
from captioner.vocab import Vocab

from .conftest import optimise, tiny_decoder

B, P, D, H, V = 3, 9, 16, 10, 12
PAD, START, END, UNK = 0, 1, 2, 3
IDS = SpecialIds(START, END, PAD)
S = DecodeConfig  # decode settings: the defaults with the given fields changed
SCORES = ("attention.feat_proj.weight", "attention.hidden_proj.weight", "attention.score.weight")  # W_a, W_h, w

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_of(attention: str = "hard", dropout: float = 0.0) -> Decoder:
    """The shared tiny decoder (tests/conftest.py), hard unless asked."""
    return tiny_decoder(V, dropout, attention)


def twins() -> tuple[Decoder, Decoder]:
    """A soft and a hard decoder with the same weights."""
    soft = tiny_of("soft").eval()
    hard = tiny_of("hard").eval()
    missing, unexpected = hard.load_state_dict(soft.state_dict(), strict=False)
    assert missing == ["reinforce_baseline"] and not unexpected  # the hard model's only extra state
    return soft, hard


def one_step(dec: Decoder, feats: torch.Tensor, G: int, context: str):
    """recur for G rows per image from random hidden states -> (z, alpha, beta, where)."""
    h = torch.randn(feats.shape[0] * G, H)
    emb_gates = torch.randn(feats.shape[0] * G, 4 * H)
    z, alpha, beta, where, _ = dec.recur((h, torch.zeros_like(h)), emb_gates, feats, dec.attention.project(feats),
                                         context)
    return z, alpha, beta, where


@pytest.mark.parametrize("G", [1, 3])  # 3: rows of one image share its features, as beams do
def test_sampled_context_is_the_gated_annotation_at_the_sampled_location(G):
    dec = tiny_of()
    feats = torch.randn(B, P, D)
    z, alpha, beta, where = one_step(dec, feats, G, "sample")
    image = torch.arange(B).repeat_interleave(G)  # (B*G,)
    assert where.shape == (B * G,) and ((where >= 0) & (where < P)).all()
    assert torch.equal(z, beta.unsqueeze(1) * feats[image, where])  # exactly beta * a_{s_t}
    # not the expected context: that one mixes all regions
    assert not torch.allclose(z, beta.unsqueeze(1) * torch.einsum("np,npd->nd", alpha, feats[image]), atol=1e-4)


def test_argmax_context_is_the_gated_annotation_at_the_most_attended_region():
    dec = tiny_of()
    feats = torch.randn(B, P, D)
    z, alpha, beta, where = one_step(dec, feats, 2, "argmax")
    assert torch.equal(where, alpha.argmax(-1))
    assert torch.equal(z, beta.unsqueeze(1) * feats[torch.arange(B).repeat_interleave(2), alpha.argmax(-1)])


def test_sampled_locations_follow_alpha():
    """Frequencies of 40000 draws match alpha within 5 standard errors; argmax or a uniform draw fails."""
    torch.manual_seed(1)
    alpha = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.05])
    n = 40_000
    where = locate(alpha.expand(n, -1), "sample")
    freq = torch.bincount(where, minlength=5).float() / n
    assert (freq - alpha).abs().max() < 5 * (0.25 / n) ** 0.5  # 0.0125
    # the same through the decoder: one image, identical hidden states -> identical alphas per row
    dec = tiny_of()
    feats = torch.randn(1, P, D)
    h = torch.randn(1, H).expand(n, -1).contiguous()
    _, a, _, w, _ = dec.recur((h, torch.zeros_like(h)), torch.zeros(n, 4 * H), feats, dec.attention.project(feats),
                              "sample")
    freq = torch.bincount(w, minlength=P).float() / n
    assert (freq - a[0]).abs().max() < 5 * (0.25 / n) ** 0.5


def test_expected_mode_of_a_hard_model_is_the_soft_model():
    soft, hard = twins()
    feats = torch.randn(B, P, D)
    inputs = torch.randint(4, V, (B, 5))
    inputs[:, 0] = START
    lengths = torch.tensor([5, 4, 2])
    with torch.no_grad():
        for a, b in zip(soft.teacher_force(feats, inputs, lengths), hard.teacher_force(feats, inputs, lengths)):
            assert (a is None and b is None) or torch.equal(a, b)
    greedy = lambda dec, **kw: [h for (h,) in decode(dec, feats, IDS, S(beam_size=1, max_len=12, **kw))]  # noqa: E731
    g_soft, g_hard = greedy(soft), greedy(hard)
    assert [h.tokens for h in g_soft] == [h.tokens for h in g_hard]
    assert all(torch.equal(a.alphas, b.alphas) for a, b in zip(g_soft, g_hard))
    b_soft = beam_search(soft, feats, IDS, S(beam_size=3, max_len=12))
    b_hard = beam_search(hard, feats, IDS, S(beam_size=3, max_len=12))
    assert [[h.tokens for h in hs] for hs in b_soft] == [[h.tokens for h in hs] for hs in b_hard]
    # argmax decoding attends differently (one region per word), so its gated contexts, and in general
    # its captions' scores, differ; a soft model ignores the setting
    a_hard = greedy(hard, hard_context="argmax")
    assert [h.log_prob for h in a_hard] != [h.log_prob for h in g_hard]
    a_soft = greedy(soft, hard_context="argmax")
    assert [h.log_prob for h in a_soft] == [h.log_prob for h in g_soft]
    assert not hasattr(hard, "decode_context")  # how it attends is an argument, never decoder state


def test_scst_samples_of_a_hard_model_use_the_expected_context():
    soft, hard = twins()
    feats = torch.randn(B, P, D)
    torch.manual_seed(3)
    s_soft = sample(soft, feats, IDS, n_samples=4, max_len=8)
    torch.manual_seed(3)
    s_hard = sample(hard, feats, IDS, n_samples=4, max_len=8)
    assert torch.equal(s_soft.tokens, s_hard.tokens) and torch.equal(s_soft.log_probs, s_hard.log_probs)


def _captions(n: int = 3, T: int = 6):
    inputs = torch.randint(4, V, (n, T))
    inputs[:, 0] = START
    targets = torch.randint(4, V, (n, T))
    lengths = torch.tensor([T, T - 2, 2][:n])
    mask = torch.arange(T)[None] < lengths[:, None]
    inputs[~mask], targets[~mask] = PAD, PAD
    return inputs, targets, lengths


def test_location_log_probs_cover_real_steps_only():
    dec = tiny_of()
    feats = torch.randn(B, P, D)
    inputs, targets, lengths = _captions()
    torch.manual_seed(5)
    _, alphas, _, loc_logp = dec.teacher_force(feats, inputs, lengths, context="sample")
    assert loc_logp.shape == (B,) and torch.isfinite(loc_logp).all()
    mask = torch.arange(inputs.shape[1])[None] < lengths[:, None]  # (B, T)
    # each step's term log alpha_t[s_t] lies between the log of its smallest and largest alpha
    lo = (alphas.clamp_min(1e-30).log().amin(-1) * mask).sum(1)
    hi = (alphas.clamp_min(1e-30).log().amax(-1) * mask).sum(1)
    assert (lo <= loc_logp + 1e-5).all() and (loc_logp <= hi + 1e-5).all()
    other = inputs.clone()
    other[~mask] = 7  # padding can change freely: the same draws give the same sum
    torch.manual_seed(5)
    assert torch.equal(dec.teacher_force(feats, other, lengths, context="sample").loc_logp, loc_logp)
    with pytest.raises(ValueError, match="hard-attention decoder"):
        tiny_of("soft").teacher_force(feats, inputs, lengths, context="sample")


def test_reinforce_is_what_trains_the_attention_scores():
    """Cross-entropy through a sampled one-hot context never reaches W_a, W_h, w (the draw is not
    differentiable): without the REINFORCE term hard attention could not learn where to look."""
    dec = tiny_of()
    feats = torch.randn(B, P, D)
    inputs, targets, lengths = _captions()
    logits, alphas, _, loc_logp = dec.teacher_force(feats, inputs, lengths, context="sample")
    ce = caption_loss(logits, alphas, targets, lengths, alpha_c=0.0)
    ce.total.backward(retain_graph=True)
    for name in SCORES:
        g = dec.get_parameter(name).grad
        assert g is None or not g.any(), name
    assert dec.get_parameter("out_vocab.weight").grad.abs().sum() > 0  # the words did learn
    assert dec.get_parameter("attention.gate.weight").grad.abs().sum() > 0  # and the gate beta
    dec.zero_grad()
    log_lik = caption_log_likelihood(logits, targets, lengths)
    h = hard_attention_terms(log_lik, loc_logp, alphas, torch.tensor(0.0), ce.n_tokens, reinforce=1.0, entropy=0.0)
    h.total.backward()
    for name in SCORES:
        g = dec.get_parameter(name).grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, name
    assert dec.get_parameter("out_vocab.weight").grad is None  # the reward is a constant: no gradient to the words


def test_log_likelihood_is_minus_the_summed_cross_entropy():
    logits = torch.randn(B, 6, V)
    inputs, targets, lengths = _captions()
    ce = caption_loss(logits, torch.zeros(B, 6, P), targets, lengths, alpha_c=0.0)
    total = caption_log_likelihood(logits, targets, lengths).sum()
    assert total.item() == pytest.approx(-ce.xent.item() * ce.n_tokens, rel=1e-5)


def _objective(expected_prob: float, decay: float = 0.9) -> CrossEntropy:
    cfg = Config()
    cfg.model.attention = "hard"
    cfg.train.alpha_c = 0.0
    cfg.train.hard_expected_prob = expected_prob
    cfg.train.hard_baseline_decay = decay
    return CrossEntropy(cfg)


def _batch(n_images: int = 4, n_caps: int = 2, T: int = 6):
    g = torch.Generator().manual_seed(7)
    data = []
    for _ in range(n_images):
        caps = [[START] + torch.randint(4, V, (int(torch.randint(2, T, (1,), generator=g)),), generator=g).tolist()
                + [END] for _ in range(n_caps)]
        data.append((torch.randn(P, D, generator=g), caps))
    return collate(data)


def test_moving_average_baseline_updates_and_survives_a_checkpoint(tmp_path):
    b = torch.tensor(2.0)
    update_baseline(b, torch.tensor([-3.0, -5.0]), decay=0.9)
    assert b.item() == pytest.approx(0.9 * 2.0 + 0.1 * -4.0)
    # through the objective: a sampled batch moves the decoder's buffer, an expected one does not
    model = ShowAttendTell(torch.nn.Identity(), tiny_of().train())  # type: ignore[arg-type]
    batch = _batch()
    terms = _objective(expected_prob=0.0, decay=0.75)(model, batch)
    assert terms.logs["sampled"] == 1.0 and terms.logs["baseline"] == 0.0 and terms.logs["reinforce"] != 0.0
    mean_log_lik = -terms.logs["xent"] * terms.weight / len(batch.lengths)  # xent is per token, no smoothing
    b1 = model.decoder.reinforce_baseline.item()
    assert b1 == pytest.approx(0.25 * mean_log_lik, rel=1e-4) and b1 < 0
    terms = _objective(expected_prob=1.0)(model, batch)
    assert terms.logs["sampled"] == 0.0 and terms.logs["reinforce"] == 0.0
    assert model.decoder.reinforce_baseline.item() == b1
    # the buffer is part of the weights: a checkpoint keeps it, and its config says "hard"
    cfg = Config()
    cfg.model.attention = "hard"
    path = tmp_path / "hard.safetensors"
    save_checkpoint(path, cfg, Vocab(["<pad>", "<start>", "<end>", "<unk>"] + [f"w{i}" for i in range(V - 4)]),
                    model.state_dict())
    ckpt = load_checkpoint(path)
    assert ckpt.config.model.attention == "hard"
    again = tiny_of(ckpt.config.model.attention)
    load_model_state(again, {k.removeprefix("decoder."): v for k, v in ckpt.model_state.items()}, str(path))
    assert again.reinforce_baseline.item() == b1


def test_old_configs_without_the_key_are_soft():
    d = Config().to_dict()
    del d["model"]["attention"], d["decode"]["hard_context"]
    cfg = Config.from_dict(d)
    assert cfg.model.attention == "soft" and cfg.decode.hard_context == "expected"
    assert not hasattr(tiny_of("soft"), "reinforce_baseline")  # soft state dicts are unchanged


def test_a_tiny_hard_model_learns():
    """30 Adam steps on one synthetic batch (half of them with sampled contexts) lower the loss."""
    torch.manual_seed(0)
    model = ShowAttendTell(torch.nn.Identity(), tiny_of().train())  # type: ignore[arg-type]
    objective = _objective(expected_prob=0.5)
    objective.cfg.train.alpha_c = 1.0
    logs = optimise(objective, model, _batch(), steps=30, lr=3e-2)
    xents, sampled = [r["xent"] for r in logs], [r["sampled"] for r in logs]
    assert 0 < sum(sampled) < 30  # both kinds of batches occurred
    assert sum(xents[-5:]) / 5 < 0.7 * sum(xents[:5]) / 5, xents
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_bad_choices_are_clear_errors():
    with pytest.raises(ValueError, match="model.attention must be one of soft, hard, got 'bogus'"):
        load_config(overrides=["model.attention=bogus"])
    with pytest.raises(ValueError, match="decode.hard_context must be one of expected, argmax"):
        load_config(overrides=["decode.hard_context=sample"])
    with pytest.raises(ValueError, match="model.attention must be one of soft, hard"):
        tiny_of("bogus")
    assert load_config(overrides=["model.attention=hard"]).model.attention == "hard"
    with pytest.raises(ValueError, match="train.hard_expected_prob must be in"):
        _objective(expected_prob=1.5)


def test_init_from_switches_between_soft_and_hard():
    """train.init_from a soft model's file into a hard run (and back): the weights carry over, the
    REINFORCE baseline is the new run's own (0 for a hard run, absent from a soft one)."""
    from captioner.model.show_attend_tell import build_model
    from captioner.training.run import _model

    cfg = Config()
    cfg.model.pretrained = False
    cfg.model.embed_dim = cfg.model.hidden_dim = cfg.model.attention_dim = 16
    soft = build_model(cfg.model, V)
    cfg.model.attention = "hard"
    hard = _model(cfg, V, soft.state_dict(), fresh=True, log=lambda _: None)
    assert hard.decoder.hard and hard.decoder.reinforce_baseline.item() == 0.0
    assert torch.equal(hard.decoder.attention.score.weight, soft.decoder.attention.score.weight)
    hard.decoder.reinforce_baseline.fill_(-3.0)
    cfg.model.attention = "soft"
    back = _model(cfg, V, hard.state_dict(), fresh=True, log=lambda _: None)
    assert not back.decoder.hard and "decoder.reinforce_baseline" not in back.state_dict()
