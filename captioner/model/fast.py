"""The CPU fast path: the reference step of model/attention.py and model/decoder.py, computed faster.

Every trick here gives the reference's numbers to float rounding (tests/test_fast_decoding.py checks
each one, and that greedy and beam search write the same captions either way). Legend: B images,
G rows per image (beams), N = B*G rows, P regions, D annotation dim, A attention dim, E embedding
dim, H hidden dim, V vocabulary.

- Eq. 4 through tanh(x) = 2 sigmoid(2x) - 1 (`SigmoidAttention`): e_ti = 2 w^T sigmoid(2 u_ti) + b - sum(w)
  with u_ti = W_a a_i + W_h h_{t-1}, the factors 2 folded into the projections. PyTorch's CPU tanh
  kernel is ~3.4x slower than its sigmoid, and the (N, P, A) elementwise part of eq. 4 is the largest
  cost of a step after the matrix products: teacher forcing (training, explain) uses this form too
  (the literal tanh made a CPU training step ~8% slower).
- Without autograd on CPU, eq. 4 is evaluated a few images at a time in one reused buffer of about
  BLOCK_ELEMENTS elements (1 MiB fp32) that stays in cache: a beam step over 100 images x 3 beams
  would otherwise write and re-read a 50 MB (N, P, A) temporary three times (4-10x slower).
- Few-row products with the operands swapped (`linear`): MKL's fp32 product of a (K, in) matrix by
  nn.Linear's (out, in) weight is slow for K ~ 5 rows; y^T = W x^T + b measured 25-40% faster on a
  2-core AVX2 EPYC with one thread ((5, 512) x (512, 2540) 1.59 -> 0.93 ms), equal for 1 and 81 rows.
- W_z a_i once per image (`FastDecoder.context_gates`): z_t = beta_t sum_i alpha_ti a_i is linear in the
  a_i, so W_z z_t = beta_t sum_i alpha_ti (W_z a_i): a beam step reads a (P, 4H) table per image instead
  of multiplying its rows by W_z, the step's largest product.
- Each word's W_e E y computed once (`FastDecoder.embed` without autograd): a (V, 4H) table filled as
  words first occur, kept per decoder and dropped when either weight changes or moves.

Decoding (decoding/search.py) and sampling (decoding/sampling.py) step through `inference(decoder)`.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import AdditiveAttention, glimpse, locate

BLOCK_ELEMENTS = 1 << 18  # elements of the buffer eq. 4 is evaluated in without autograd (CPU)
FEW_ROWS = (2, 16)  # rows for which `linear` swaps the operands (CPU)


def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """layer(x) for x (N, in) -> (N, out); for FEW_ROWS rows on CPU computed as (W x^T + b)^T, a
    transposed view (no weight is copied or cached)."""
    if x.dim() != 2 or not FEW_ROWS[0] <= x.shape[0] <= FEW_ROWS[1] or x.device.type != "cpu":
        return F.linear(x, layer.weight, layer.bias)
    if layer.bias is None:
        return torch.mm(layer.weight, x.t()).t()  # (N, out)
    return torch.addmm(layer.bias.unsqueeze(1), layer.weight, x.t()).t()  # (N, out)


class SigmoidAttention:
    """AdditiveAttention's eq. 4-5 and gate evaluated through sigmoid (its parameters, nothing copied).
    `project` gives 2 W_a a_i: a feat_proj from it goes with this class's `weights` only."""

    def __init__(self, attention: AdditiveAttention):
        self.attention = attention

    def project(self, feats: torch.Tensor) -> torch.Tensor:
        """feats (B, P, D) -> 2 W_a a_i (B, P, A), once per image."""
        return 2 * self.attention.feat_proj(feats)

    def weights(self, feats: torch.Tensor, feat_proj: torch.Tensor, h: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """feats (B, P, D), feat_proj (B, P, A) from `project`, h (N, H) -> alpha (N, P), beta (N,)."""
        att = self.attention
        B, P, _ = feats.shape
        G = h.shape[0] // B
        hp = 2 * linear(att.hidden_proj, h).reshape(B, G, 1, -1)  # (B, G, 1, A): 2 W_h h
        w = att.score.weight.t()  # (A, 1)
        if torch.is_grad_enabled() or feat_proj.device.type != "cpu":
            s = torch.sigmoid(feat_proj.unsqueeze(1) + hp) @ w  # (B, G, P, 1)
        else:
            s = _sigmoid_scores_blocked(feat_proj, hp, w)
        e = 2 * s.view(B * G, P) + (att.score.bias - w.sum())  # (N, P): eq. 4
        alpha = torch.softmax(e, dim=-1)  # (N, P): eq. 5
        beta = torch.sigmoid(att.gate(h))  # (N, 1)
        return alpha, beta.squeeze(1)


def _sigmoid_scores_blocked(feat_proj: torch.Tensor, hp: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sigmoid(feat_proj + hp) @ w without autograd, a block of images at a time in one buffer.
    feat_proj (B, P, A), hp (B, G, 1, A), w (A, 1) -> (B, G, P, 1)."""
    B, P, A = feat_proj.shape
    G = hp.shape[1]
    block = max(1, BLOCK_ELEMENTS // (G * P * A))  # images per block
    buf = feat_proj.new_empty(min(block, B), G, P, A)
    out = feat_proj.new_empty(B, G, P, 1)
    for k in range(0, B, block):
        n = min(block, B - k)
        u = torch.add(feat_proj[k:k + n].unsqueeze(1), hp[k:k + n], out=buf[:n])  # (n, G, P, A)
        torch.matmul(u.sigmoid_(), w, out=out[k:k + n])
    return out


# word-gate tables per decoder: (key of the weights, (V, 4H) table, (V,) bool rows known)
_WORD_GATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def whole_table(device: torch.device) -> bool:
    """A GPU fills the word-gate table in one product the first time (reading back which words are known would
    wait for the device at every step); a CPU fills it as words occur (a few rows per step are cheaper)."""
    return device.type != "cpu"


def word_gates(decoder: nn.Module, words: torch.Tensor) -> torch.Tensor:
    """W_e E y of `words` (...,) -> (..., 4H) from the decoder's (V, 4H) table, filled as words first
    occur: a beam step looks its K rows up instead of a (K, E) x (E, 4H) product. The table is dropped
    when either weight changes (training steps bump their versions) or moves; rows are written before
    they are marked known, and identical values may be written twice (concurrent callers)."""
    w_emb, w_gate = decoder.embedding.weight, decoder.gates_embed.weight
    key = (w_emb._version, w_gate._version, w_emb.data_ptr(), w_gate.data_ptr(), w_gate.dtype, w_gate.device)
    cache = _WORD_GATES.get(decoder)
    whole = whole_table(w_gate.device)
    if cache is None or cache[0] != key:
        cache = (key, decoder.gates_embed(w_emb) if whole else w_gate.new_empty(decoder.vocab_size, w_gate.shape[0]),
                 torch.full((decoder.vocab_size,), whole, dtype=torch.bool, device=w_gate.device))  # (V, 4H), (V,)
        _WORD_GATES[decoder] = cache
    _, table, known = cache
    if whole:  # every row made at once: no read of `known` (a host sync per step on a GPU)
        return table[words]  # (..., 4H)
    if not bool(known[words].all()):
        new = words[~known[words]].unique()  # (n,) words seen for the first time
        table[new] = decoder.gates_embed(decoder.embedding(new))  # (n, 4H)
        known[new] = True
    return table[words]  # (..., 4H)


class Steps:
    """What decoding steps through: `attention.project`, `context_gates`, `init_state`, `embed` and `step`
    (decoding/search.py). `inference` passes a Steps through unchanged (bench/naive.py's reference)."""

    hard: bool


class FastDecoder(Steps):
    """A Decoder's step with every trick above; the decoder's own parameters, nothing copied. With
    autograd (SCST sampling) only the sigmoid form and the few-row products apply."""

    def __init__(self, decoder: nn.Module):
        self.decoder, self.hard = decoder, decoder.hard
        self.attention = SigmoidAttention(decoder.attention)

    def init_state(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decoder.init_state(feats)  # (B, H) x2

    def embed(self, words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """words (...,) -> E y (..., E), W_e E y (..., 4H): looked up without autograd."""
        d = self.decoder
        emb = d.embedding(words)
        return emb, (d.gates_embed(emb) if torch.is_grad_enabled() else word_gates(d, words))

    def context_gates(self, feats: torch.Tensor) -> torch.Tensor:
        """W_z a_i for every region: feats (B, P, D) -> (B, P, 4H), once per image, for `step`'s ctx_gates."""
        return self.decoder.gates_context(feats)

    def step(self, state: tuple[torch.Tensor, torch.Tensor], emb: torch.Tensor, emb_gates: torch.Tensor,
             feats: torch.Tensor, feat_proj: torch.Tensor, context: str = "expected",
             ctx_gates: torch.Tensor | None = None):
        """Decoder.step (same arguments, feat_proj from `attention.project`) -> logits (N, V), alpha (N, P),
        beta (N,), new state. ctx_gates: `context_gates(feats)` (B, P, 4H), or None for W_z z_t."""
        d, (h, c) = self.decoder, state
        alpha, beta = self.attention.weights(feats, feat_proj, h)  # (N, P), (N,)
        where = locate(alpha, context if self.hard else "expected")  # (N,) or None
        weights = alpha if where is None else F.one_hot(where, alpha.shape[1]).to(alpha.dtype)  # (N, P)
        z = glimpse(feats, weights, beta)  # (N, D)
        z_gates = linear(d.gates_context, z) if ctx_gates is None else glimpse(ctx_gates, weights, beta)
        gates = emb_gates + z_gates + linear(d.gates_hidden, h)  # (N, 4H): eq. 1
        i, f, g, o = gates.chunk(4, dim=1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)  # (N, H)
        h = torch.sigmoid(o) * torch.tanh(c)  # (N, H)
        out = torch.tanh(emb + linear(d.out_hidden, h) + linear(d.out_context, z))  # (N, E): eq. 7
        return linear(d.out_vocab, d.dropout(out)), alpha, beta, (h, c)  # logits (N, V)


def inference(decoder) -> Steps:
    """What decoding steps through: a Decoder's FastDecoder; a Steps as it is."""
    return decoder if isinstance(decoder, Steps) else FastDecoder(decoder)
