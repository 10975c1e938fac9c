"""Invariants of the attention, decoder, loss and decoding (random tensors, no data needed)."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from captioner.bench.naive import naive_decoder
from captioner.config import DecodeConfig
from captioner.decoding.rules import unruled
from captioner.decoding.search import beam_search, decode
from captioner.training.loss import caption_loss
from captioner.model.attention import AdditiveAttention, glimpse
from captioner.model.decoder import Decoder

from captioner.vocab import SpecialIds

from .conftest import END, IDS, PAD, START, B, D, P, batch, tiny_decoder
from .greedy_oracle import greedy_decode


def S(**settings) -> DecodeConfig:
    """Decode settings for a test: the defaults with `settings` changed; the salad and repeat rules off
    unless asked (an untrained decoder over a 12-word vocabulary repeats words, which is what several tests
    need)."""
    return unruled(**settings)


def test_attention_is_a_distribution_and_gated():
    att = AdditiveAttention(D, 10, 7)
    feats = torch.randn(B, P, D)
    alpha, beta = att.weights(feats, att.project(feats), torch.randn(B, 10))
    z = glimpse(feats, alpha, beta)  # the expected context, as Decoder.recur forms it
    assert z.shape == (B, D) and alpha.shape == (B, P)
    assert torch.allclose(alpha.sum(-1), torch.ones(B), atol=1e-6)
    assert (alpha >= 0).all()
    # context is beta * (convex combination): with beta in (0, 1) its norm is below the max annotation norm
    assert (z.norm(dim=-1) <= feats.norm(dim=-1).max(dim=-1).values + 1e-5).all()
    # beta is the gate that scales the context: z = beta * sum_i alpha_i a_i, beta in (0, 1)
    assert beta.shape == (B,) and ((beta > 0) & (beta < 1)).all()
    assert torch.allclose(z, beta[:, None] * torch.einsum("bp,bpd->bd", alpha, feats), atol=1e-5)



@pytest.mark.parametrize("literal,grad", [(True, True), (False, True), (False, False)])
def test_attention_equals_equations_4_to_6(literal, grad, monkeypatch):
    """AdditiveAttention.weights as every path runs it on a CPU (eq. 4 through sigmoid, cache-blocked without
    autograd) and as the paper writes it (literal=True) compute eq. 4-6: several images per block and a
    partial last block (7 images, 2 per block), beams sharing their image (G = 3)."""
    from captioner.model import attention

    monkeypatch.setattr(attention, "BLOCK_ELEMENTS", 2 * 3 * P * 7)  # 2 images per block
    att = AdditiveAttention(D, 10, 7)
    with torch.no_grad():
        att.score.bias.fill_(0.3)
    n, G = 7, 3
    feats, h = torch.randn(n, P, D), torch.randn(n * G, 10)
    with torch.set_grad_enabled(grad):
        alpha, beta = att.weights(feats, att.project(feats), h, literal)
        z = glimpse(feats, alpha, beta)
    with torch.no_grad():  # eq. 4-6 written out literally, one row at a time
        for r in range(n * G):
            a = feats[r // G]  # (P, D)
            e = att.score(torch.tanh(att.feat_proj(a) + att.hidden_proj(h[r]))).squeeze(-1)  # (P,)
            ref_alpha = torch.softmax(e, dim=0)
            ref_z = torch.sigmoid(att.gate(h[r])) * (ref_alpha @ a)
            torch.testing.assert_close(alpha[r], ref_alpha, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(z[r], ref_z, rtol=1e-5, atol=1e-6)


def test_teacher_forcing_shapes_and_alphas_sum_to_one():
    V = 12
    dec = tiny_decoder(V)
    inputs, _, lengths, mask = batch(V)
    logits, alphas, betas, _ = dec.teacher_force(torch.randn(B, P, D), inputs, lengths)
    assert logits.shape == (B, inputs.shape[1], V) and alphas.shape == (B, inputs.shape[1], P)
    assert betas.shape == (B, inputs.shape[1]) and ((betas[mask] > 0) & (betas[mask] < 1)).all()
    assert torch.allclose(alphas.sum(-1)[mask], torch.ones(int(mask.sum())), atol=1e-6)
    assert (alphas[~mask] == 0).all() and (logits[~mask] == 0).all() and (betas[~mask] == 0).all()  # padding never computed


def test_teacher_forcing_equals_manual_steps_and_naive_path():
    V = 12
    dec = tiny_decoder(V)
    feats = torch.randn(B, P, D)
    inputs, targets, lengths, mask = batch(V)
    logits, alphas, betas, _ = dec.teacher_force(feats, inputs, lengths)
    # the same computation written as an explicit loop over Decoder.step
    state = dec.init_state(feats)
    proj = dec.attention.project(feats)
    for t in range(inputs.shape[1]):
        emb, eg = dec.embed(inputs[:, t])
        lg, al, be, state = dec.step(state, emb, eg, feats, proj)
        rows = lengths > t
        assert torch.allclose(lg[rows], logits[rows, t], atol=1e-5)
        assert torch.allclose(al[rows], alphas[rows, t], atol=1e-6)
        assert torch.allclose(be[rows], betas[rows, t], atol=1e-6)
    # the benchmark's naive path (the literal step at every padded position) gives the same loss
    from captioner.bench.naive import naive_loss
    from captioner.config import Config
    from captioner.data.dataset import Batch

    a = caption_loss(logits, alphas, targets, lengths)
    b = naive_loss(dec, feats, Batch(feats, inputs, targets, lengths, torch.arange(B)), Config())
    assert torch.allclose(a.total, b.total, atol=1e-5)


def test_captions_share_their_image_projection():
    V = 12
    dec = tiny_decoder(V)
    feats = torch.randn(2, P, D)
    inputs, _, lengths, _ = batch(V, (5, 4, 3))
    index = torch.tensor([1, 0, 1])
    shared = dec.teacher_force(feats, inputs, lengths, image_index=index).logits
    copied = dec.teacher_force(feats[index], inputs, lengths).logits
    assert torch.allclose(shared, copied, atol=1e-6)


def test_gradients_of_shared_images_are_the_same_every_time_at_2_threads():
    """Five captions an image, as in training: the gradient that flows back to each image's annotations (and to
    W_a a_i) is summed over its captions in one order at 2 threads, so two identical steps give bit-identical
    gradients. Indexing with repeated indices (feats[image_index]) summed them by racing atomic adds, in a
    different order each time, and a resumed run drifted from the uninterrupted one."""
    V, images, per_image, p, d = 12, 4, 5, 49, 64
    dec = Decoder(V, d, embed_dim=8, hidden_dim=10, attention_dim=64).train()
    feats = torch.randn(images, p, d)
    inputs, targets, lengths, mask = batch(V, [6] * images * per_image)
    index = torch.arange(images).repeat_interleave(per_image)[torch.randperm(images * per_image)]  # (B,) mixed
    old, grads = torch.get_num_threads(), set()
    try:
        torch.set_num_threads(2)
        for _ in range(6):
            f = feats.clone().requires_grad_()
            torch.manual_seed(0)  # the same dropout masks
            logits = dec.teacher_force(f, inputs, lengths, image_index=index).logits  # (B, T, V)
            logits[mask].logsumexp(-1).sum().backward()
            grads.add(f.grad.numpy().tobytes())
    finally:
        torch.set_num_threads(old)
    assert len(grads) == 1


def test_untrained_loss_is_about_log_vocab():
    V = 1000
    dec = Decoder(V, 64, 32, 32, 32, dropout=0.0)
    feats = torch.randn(8, 49, 64)
    inputs, targets, lengths, _ = batch(V, (12, 11, 10, 9, 8, 7, 6, 5))
    logits, alphas, betas, _ = dec.teacher_force(feats, inputs, lengths)
    xent = caption_loss(logits, alphas, targets, lengths).xent.item()
    assert abs(xent - math.log(V)) < 0.15 * math.log(V), (xent, math.log(V))


def test_padding_does_not_change_the_loss():
    V = 12
    dec = tiny_decoder(V)
    feats = torch.randn(B, P, D)
    inputs, targets, lengths, mask = batch(V)
    logits, alphas, betas, _ = dec.teacher_force(feats, inputs, lengths)
    ref = caption_loss(logits, alphas, targets, lengths, alpha_c=1.0)
    inputs2, targets2 = inputs.clone(), targets.clone()
    inputs2[~mask] = torch.randint(0, V, (int((~mask).sum()),))
    targets2[~mask] = torch.randint(0, V, (int((~mask).sum()),))
    logits2, alphas2, _, _ = dec.teacher_force(feats, inputs2, lengths)
    other = caption_loss(logits2, alphas2, targets2, lengths, alpha_c=1.0)
    assert torch.equal(ref.total, other.total) and torch.equal(ref.xent, other.xent)
    assert ref.n_tokens == int(lengths.sum())


def test_doubly_stochastic_penalty_is_reported_separately():
    V = 12
    dec = tiny_decoder(V)
    inputs, targets, lengths, _ = batch(V)
    logits, alphas, betas, _ = dec.teacher_force(torch.randn(B, P, D), inputs, lengths)
    with_pen = caption_loss(logits, alphas, targets, lengths, alpha_c=2.0)
    no_pen = caption_loss(logits, alphas, targets, lengths, alpha_c=0.0)
    expected = ((1 - alphas.sum(1)) ** 2).sum(1)  # (B,)
    assert torch.allclose(with_pen.penalty, 2.0 * expected.mean())
    assert torch.allclose(with_pen.total - no_pen.total, 2.0 * expected.sum() / lengths.sum())
    assert no_pen.penalty.item() == 0.0


@pytest.mark.parametrize("images", [1, 5])
def test_beam_one_equals_greedy(images):
    """Beam 1 is greedy decoding (tests/greedy_oracle.py: the argmax of each step, its own loop): the same words,
    maps, gates and word log-probs, and decode() scores it by its log-probability. Bit for bit over a batch (no
    W_z a_i table, as the oracle); one image reads the table, equal to float rounding."""
    dec = tiny_decoder(30)
    feats = torch.randn(images, P, D) * 3
    g = greedy_decode(dec, feats, IDS, S(max_len=12))
    b = beam_search(dec, feats, IDS, S(beam_size=1, max_len=12))
    for gh, (bh,), (dh,) in zip(g, b, decode(dec, feats, IDS, S(beam_size=1, max_len=12))):
        assert gh.tokens == bh.tokens == dh.tokens
        assert gh.log_prob == pytest.approx(bh.log_prob, abs=1e-5) and dh.score == dh.log_prob == bh.log_prob
        assert torch.allclose(gh.alphas, bh.alphas, atol=1e-6) and torch.allclose(gh.betas, bh.betas, atol=1e-6)
        assert torch.allclose(gh.word_logps, bh.word_logps, atol=1e-5)
        if images > 1:
            assert torch.equal(gh.alphas, bh.alphas) and torch.equal(gh.word_logps, bh.word_logps)


def _brute_force(dec, feats, max_len, V):
    """Score every sequence over the allowed tokens exactly (what beam search approximates)."""
    allowed = [w for w in range(V) if w not in (PAD, START)]
    best = (-math.inf, None)
    for L in range(1, max_len + 1):
        for seq in itertools.product(allowed, repeat=L):
            if END in seq[:-1]:
                continue
            if L < max_len and seq[-1] != END:
                continue  # shorter than max_len must end with <end>; at max_len it is capped
            inputs = torch.tensor([[START, *seq[:-1]]])
            logits = dec.teacher_force(feats, inputs, torch.tensor([L])).logits
            lp = torch.log_softmax(logits[0], -1)
            lp[:, PAD] = lp[:, START] = -math.inf
            s = sum(lp[t, w].item() for t, w in enumerate(seq))
            if s > best[0]:
                best = (s, [w for w in seq if w != END])
    return best


def test_wide_beam_equals_brute_force():
    V = 6  # pad, start, end, unk + 2 words
    dec = tiny_decoder(V)
    with torch.no_grad():
        dec.out_vocab.bias[END] -= 1.0  # make long captions competitive so the search is not trivial
    max_len = 4
    for seed in range(3):
        feats = torch.randn(1, P, D, generator=torch.Generator().manual_seed(seed)) * 2
        score, tokens = _brute_force(dec, feats, max_len, V)
        hyp = beam_search(dec, feats, IDS, S(beam_size=128, max_len=max_len))[0][0]
        assert hyp.tokens == tokens
        assert hyp.log_prob == pytest.approx(score, abs=1e-4)


def test_beam_search_never_crashes_without_end_and_maps_sum_to_one():
    dec = tiny_decoder(20)
    with torch.no_grad():
        dec.out_vocab.bias[END] = -1e4  # <end> is never chosen: every hypothesis hits the cap
    feats = torch.randn(4, P, D)
    for k in (1, 3, 5):
        for hyps in decode(dec, feats, IDS, S(beam_size=k, max_len=7)):
            assert 1 <= len(hyps) <= k
            for h in hyps:
                assert len(h.tokens) == 7 and h.alphas.shape == (7, P)
                assert torch.allclose(h.alphas.sum(-1), torch.ones(7), atol=1e-5)
                assert PAD not in h.tokens and START not in h.tokens


def test_batched_decoding_equals_one_by_one():
    dec = tiny_decoder(30)
    feats = torch.randn(6, P, D) * 3
    for k in (1, 3):
        batched = decode(dec, feats, IDS, S(beam_size=k, max_len=10))
        for i in range(6):
            single = decode(dec, feats[i:i + 1], IDS, S(beam_size=k, max_len=10))[0]
            assert [h.tokens for h in batched[i]] == [h.tokens for h in single]
            assert batched[i][0].log_prob == pytest.approx(single[0].log_prob, abs=1e-4)
            if k > 1:  # the benchmark's naive mode (the literal step, W_a a_i every step) finds the same
                naive = beam_search(naive_decoder(dec), feats[i:i + 1], IDS, S(beam_size=k, max_len=10))[0]
                assert [h.tokens for h in naive] == [h.tokens for h in single]


def test_length_penalty_prefers_longer_or_equal_captions():
    dec = tiny_decoder(30)
    feats = torch.randn(6, P, D) * 3
    plain = decode(dec, feats, IDS, S(beam_size=5, max_len=15, length_penalty=0.0))
    normed = decode(dec, feats, IDS, S(beam_size=5, max_len=15, length_penalty=1.0))
    for a, b in zip(plain, normed):
        assert a[0].log_prob >= b[0].log_prob - 1e-5  # raw score ranking picks the most probable
        assert all(x.score >= y.score - 1e-6 for x, y in zip(b, b[1:]))  # sorted by the normalised score


def test_unk_can_be_forbidden():
    UNK = 3
    dec = tiny_decoder(12)
    with torch.no_grad():
        dec.out_vocab.bias[UNK] += 10.0  # <unk> would win every step
    feats = torch.randn(3, P, D)
    for k in (1, 3):
        free = decode(dec, feats, IDS, S(beam_size=k, max_len=6))
        assert any(UNK in h[0].tokens for h in free)  # the test can fail
        banned = decode(dec, feats, SpecialIds(START, END, PAD, UNK), S(beam_size=k, max_len=6))
        assert all(UNK not in h.tokens for hyps in banned for h in hyps)


def test_cpu_bf16_autocast_training_loss_matches_fp32():
    """train.cpu_amp: the loss under CPU bf16 autocast is the fp32 loss to bf16 precision, its
    gradients are finite and point the same way (matmuls in bf16, parameters stay fp32)."""
    from captioner.config import Config
    from captioner.data.dataset import Batch
    from captioner.training.run import training_autocast
    from captioner.training.objectives import CrossEntropy
    from captioner.model.show_attend_tell import ShowAttendTell

    V = 30
    torch.manual_seed(0)
    dec = Decoder(V, D, embed_dim=16, hidden_dim=16, attention_dim=16, dropout=0.0)
    model = ShowAttendTell(torch.nn.Identity(), dec).train()  # type: ignore[arg-type]
    inputs, targets, lengths, _ = batch(V)
    b = Batch(torch.randn(B, P, D), inputs, targets, lengths, torch.arange(B))
    cfg = Config()
    grads = {}
    for amp in (False, True):
        cfg.train.cpu_amp = amp
        dec.zero_grad()
        with training_autocast(torch.device("cpu"), cfg):
            terms = CrossEntropy(cfg)(model, b)
        terms.total.backward()
        assert all(p.dtype == torch.float32 for p in dec.parameters())
        grads[amp] = (terms.total.item(), torch.cat([p.grad.flatten() for p in dec.parameters() if p.grad is not None]))
    (loss32, g32), (loss16, g16) = grads[False], grads[True]
    assert loss16 != loss32  # bf16 was really in effect ...
    assert loss16 == pytest.approx(loss32, rel=2e-2)  # ... and changes the loss only at bf16 precision
    assert torch.isfinite(g16).all() and torch.nn.functional.cosine_similarity(g16, g32, dim=0) > 0.99


def _has_repeated_trigram(tokens: list[int]) -> bool:
    grams = list(zip(tokens, tokens[1:], tokens[2:]))
    return len(set(grams)) < len(grams)


def test_trigram_blocking():
    """A tiny vocabulary makes an untrained decoder repeat itself; with block_trigrams no caption
    repeats a trigram, beam 1 still equals greedy, and captions without repeats are unchanged."""
    dec = tiny_decoder(7)
    feats = torch.randn(8, P, D) * 3
    plain = decode(dec, feats, IDS, S(beam_size=1, max_len=15))
    assert any(_has_repeated_trigram(h[0].tokens) for h in plain)  # the test exercises something
    for k in (1, 3):
        blocked = decode(dec, feats, IDS, S(beam_size=k, max_len=15, block_trigrams=True))
        assert not any(_has_repeated_trigram(h.tokens) for hyps in blocked for h in hyps)
    greedy = greedy_decode(dec, feats, IDS, S(max_len=15, block_trigrams=True))
    beam1 = decode(dec, feats, IDS, S(beam_size=1, max_len=15, block_trigrams=True))
    assert [h.tokens for h in greedy] == [h[0].tokens for h in beam1]
    for p_, b_ in zip(plain, decode(dec, feats, IDS, S(beam_size=1, max_len=15, block_trigrams=True))):
        if not _has_repeated_trigram(p_[0].tokens):
            assert p_[0].tokens == b_[0].tokens


def _repeated_content_bigram(tokens: list[int], function: set[int]) -> bool:
    grams = [g for g in zip(tokens, tokens[1:]) if g[1] not in function]
    return len(set(grams)) < len(grams)


def test_bigram_blocking_spares_function_words():
    """With block_bigrams no caption repeats a bigram that ends in a content word, bigrams ending in a
    function word may repeat, beam 1 still equals greedy, and captions without such repeats are unchanged."""
    from captioner.decoding.rules import Lexicon, Rules

    from .rules_oracle import _ban_repeated_bigrams

    dec = tiny_decoder(7)
    feats = torch.randn(8, P, D) * 3
    function = (4,)  # token 4 plays "a"
    ids, lex = SpecialIds(START, END, PAD), Lexicon(function_words=function)
    ruled = lambda s: Rules(ids, s, lexicon=lex)  # noqa: E731
    plain = decode(dec, feats, ids, S(beam_size=1, max_len=15))
    assert any(_repeated_content_bigram(h[0].tokens, set(function)) for h in plain)  # the test exercises something
    for k in (1, 3):
        s = S(beam_size=k, max_len=15, block_bigrams=True)
        blocked = decode(dec, feats, ids, s, ruled(s))
        assert not any(_repeated_content_bigram(h.tokens, set(function)) for hyps in blocked for h in hyps)
    s = S(beam_size=1, max_len=15, block_bigrams=True)
    greedy = greedy_decode(dec, feats, ids, s, ruled(s))
    beam1 = decode(dec, feats, ids, s, ruled(s))
    assert [h.tokens for h in greedy] == [h[0].tokens for h in beam1]
    for p_, b_ in zip(plain, beam1):
        if not _repeated_content_bigram(p_[0].tokens, set(function)):
            assert p_[0].tokens == b_[0].tokens
    # the rule itself: after "4 5 4" word 5 is banned (a content bigram); after "5 4 5" word 4 is not
    out = _ban_repeated_bigrams(torch.zeros(2, 7), torch.tensor([[4, 5, 4], [5, 4, 5]]), function)
    assert out[0, 5] == float("-inf") and torch.isfinite(out[1]).all()
