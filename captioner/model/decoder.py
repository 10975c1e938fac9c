"""LSTM decoder with soft or hard attention and the deep output layer, Xu et al. 2015, sections 3.1.2, 4.

Legend: B batch (captions or beams), P regions, D annotation dim, E embedding dim, H hidden dim,
T steps, V vocabulary.

    h_0, c_0 = tanh(f_init,h(mean_i a_i)), tanh(f_init,c(mean_i a_i))          (section 3.1.2)
    [i f o g] = W_e E y_{t-1} + W_z z_t + W_hh h_{t-1} + b                      (eq. 1, input [E y; z])
    p(y_t)  ∝ exp(L_o tanh(E y_{t-1} + L_h h_t + L_z z_t))                      (eq. 7, deep output)

The tanh before L_o follows the authors' released code (arctic-captions). One decoder step is `recur`
(attention + LSTM cell) then `output` (deep output), each written once; `step` is the two in sequence.
Teacher-forced training loops over `recur` and applies `output` to all steps at once; greedy and beam
search (decoding/search.py, decoding/device_beam.py), sampling and SCST (decoding/sampling.py) call `step`;
explain teacher-forces. The embedding's share of the gates (W_e E y) is an input, so training computes it
for all T steps in one matrix product.

How the step computes, never what (each gives the equations' numbers to float rounding; tests/test_model.py
and tests/test_fast_decoding.py check them against `step(..., literal=True)`, plain products, and the literal
eq. 4-6):
- eq. 4 through sigmoid, in cache-sized blocks without autograd on a CPU (AdditiveAttention.weights);
- without autograd on a CPU in float32, each linear layer's product is oneDNN's with the weight packed once,
  where this torch has it, by a fixed rule (model/packed_linear.py);
- W_z a_i once per image (`context_gates`, the `ctx_gates` argument of `recur` and `step`): z_t = beta_t
  sum_i alpha_ti a_i is linear in the a_i, so W_z z_t = beta_t sum_i alpha_ti (W_z a_i): a beam step reads
  a (P, 4H) table per image instead of multiplying its rows by W_z, the step's largest product (so does
  teacher forcing of a few sentences without autograd: explain, grounding);
- each word's W_e E y computed once without autograd (`embed`): a (V, 4H) table kept by the decoder, made whole
  at load (`make_word_gates`) and again when either weight changes or moves.

Hard attention (model.attention=hard, section 4.1) changes only how `recur` forms z_t: its `context`
argument says expected (soft), sampled or argmax location (attention.locate). Training samples
(`teacher_force(..., "sample")`, or the expected context on some batches, as the authors' code
does); decoding passes decode.hard_context to `step`. The decoder holds weights (and the word-gate table
made from them) only: how it attends at decoding time is an argument, never state set from outside.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ATTENTIONS
from .attention import AdditiveAttention, glimpse, locate
from .packed_linear import Linear

State = tuple[torch.Tensor, torch.Tensor]  # (h, c), each (B, H)
FEW_SENTENCES = 16  # teacher forcing of up to this many sentences without autograd reads the W_z a_i table


class TeacherForced(NamedTuple):
    """What teacher forcing computes for every real (caption, step); zero where t >= length."""
    logits: torch.Tensor  # (B, T, V)
    alphas: torch.Tensor  # (B, T, P) attention of each step
    betas: torch.Tensor  # (B, T) gate beta of each step
    loc_logp: torch.Tensor | None  # (B,) sum_t log alpha_t[s_t] with context "sample", else None


class Decoder(nn.Module):
    def __init__(self, vocab_size: int, feat_dim: int, embed_dim: int = 512, hidden_dim: int = 512,
                 attention_dim: int = 512, dropout: float = 0.5, attention: str = "soft"):
        super().__init__()
        if attention not in ATTENTIONS:
            raise ValueError(f"model.attention must be one of {', '.join(ATTENTIONS)}, got '{attention}'")
        self.vocab_size, self.hidden_dim = vocab_size, hidden_dim
        self.hard = attention == "hard"
        self.attention = AdditiveAttention(feat_dim, hidden_dim, attention_dim)
        self.embedding = nn.Embedding(vocab_size, embed_dim)  # E
        self.init_h = Linear(feat_dim, hidden_dim)
        self.init_c = Linear(feat_dim, hidden_dim)
        # LSTM cell written out so the embedding term can be precomputed for all steps
        self.gates_embed = Linear(embed_dim, 4 * hidden_dim, bias=False)  # W_e
        self.gates_context = Linear(feat_dim, 4 * hidden_dim, bias=False)  # W_z
        self.gates_hidden = Linear(hidden_dim, 4 * hidden_dim)  # W_hh, b
        self.out_hidden = Linear(hidden_dim, embed_dim)  # L_h
        self.out_context = Linear(feat_dim, embed_dim)  # L_z
        self.dropout = nn.Dropout(dropout)
        self.out_vocab = Linear(embed_dim, vocab_size)  # L_o
        self._word_gates: tuple | None = None  # (key of the weights, (V, 4H) W_e E y): `embed` without autograd
        if self.hard:  # REINFORCE baseline b of log p(y|s,a) (loss.py); a buffer, so checkpoints and resume keep it
            self.register_buffer("reinforce_baseline", torch.zeros(()))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        # forget-gate bias 1: a common LSTM initialisation that keeps memory early in training
        with torch.no_grad():
            b = self.gates_hidden.bias
            b.zero_()
            b[self.hidden_dim:2 * self.hidden_dim] = 1.0

    def init_state(self, feats: torch.Tensor) -> State:
        mean = feats.mean(dim=1)  # (B, D)
        return torch.tanh(self.init_h(mean)), torch.tanh(self.init_c(mean))  # (B, H) each

    def embed(self, words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """words (...,) -> E y (..., E) and its share of the LSTM gates W_e E y (..., 4H) (eq. 1); without
        autograd W_e E y is looked up in the decoder's word-gate table."""
        emb = self.embedding(words)  # (..., E)
        return emb, (self.gates_embed(emb) if torch.is_grad_enabled() else self._word_gates_of(words))  # (..., 4H)

    def _word_gates_of(self, words: torch.Tensor) -> torch.Tensor:
        """W_e E y of `words` (...,) -> (..., 4H) from the (V, 4H) table: a beam step looks its K rows up instead
        of a (K, E) x (E, 4H) product. The table is made whole (make_word_gates: at load, and again when either
        weight has changed or moved since: a training step bumps its version)."""
        w_emb, w_gate = self.embedding.weight, self.gates_embed.weight
        key = (w_emb._version, w_gate._version, w_emb.data_ptr(), w_gate.data_ptr(), w_gate.dtype, w_gate.device)
        if self._word_gates is None or self._word_gates[0] != key:
            self.make_word_gates()
        return self._word_gates[1][words]  # (..., 4H)

    @torch.no_grad()
    def make_word_gates(self) -> None:
        """The word-gate table W_e E y of every word at once (V, 4H), one product (api.Captioner calls it at load).
        Made as an ordinary tensor even under torch.inference_mode, so later calls in either mode may read it."""
        w_emb, w_gate = self.embedding.weight, self.gates_embed.weight
        key = (w_emb._version, w_gate._version, w_emb.data_ptr(), w_gate.data_ptr(), w_gate.dtype, w_gate.device)
        with torch.inference_mode(False), torch.no_grad():
            self._word_gates = key, self.gates_embed(w_emb.clone() if w_emb.is_inference() else w_emb)

    def context_gates(self, feats: torch.Tensor) -> torch.Tensor:
        """W_z a_i for every region: feats (B, P, D) -> (B, P, 4H), once per image, for the `ctx_gates` of
        `recur` and `step` (beam search: its K rows per image read it at every step)."""
        if self.gates_context.bias is not None:  # beta sum_i alpha_i (W_z a_i + b) = W_z z + beta b, not W_z z + b
            raise ValueError("the W_z a_i table needs gates_context without a bias (the LSTM's bias is W_hh's)")
        return self.gates_context(feats)  # (B, P, 4H)

    def recur(self, state: State, emb_gates: torch.Tensor, feats: torch.Tensor, feat_proj: torch.Tensor,
              context: str = "expected", ctx_gates: torch.Tensor | None = None, literal: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, State]:
        """Attention and the LSTM cell for one word (eq. 4-6 or 8, eq. 1). state (B*G, H)x2, emb_gates
        (B*G, 4H) = W_e E y_{t-1}, feats (B, P, D), feat_proj (B, P, A) from attention.project -> context z
        (B*G, D), alpha (B*G, P), gate beta (B*G,), the attended location s_t (B*G,) or None for the expected
        context, new state. G rows per image (consecutive) share its features: G = 1 in training, the beam
        size in beam search. context: "expected" (soft), "sample" or "argmax" (hard; attention.locate).
        ctx_gates: `context_gates(feats)` (B, P, 4H), or None for W_z z_t. literal: eq. 4 as written."""
        h, c = state  # h_{t-1}, c_{t-1}
        alpha, beta = self.attention.weights(feats, feat_proj, h, literal)  # (B*G, P), (B*G,): eq. 4-5, 4.2.1
        where = locate(alpha, context)  # (B*G,) or None
        weights = alpha if where is None else F.one_hot(where, alpha.shape[1]).to(alpha.dtype)  # (B*G, P)
        z = glimpse(feats, weights, beta)  # (B*G, D): eq. 6 (or 8)
        if ctx_gates is None or literal:  # literal: the oracle never reads the table
            z_gates = self.gates_context(z, literal)  # (B*G, 4H): W_z z
        else:
            z_gates = glimpse(ctx_gates, weights, beta)  # (B*G, 4H): beta sum_i alpha_i (W_z a_i) = W_z z
        gates = emb_gates + z_gates + self.gates_hidden(h, literal)  # (B*G, 4H): eq. 1, W [E y; z; h] + b
        i, f, g, o = gates.chunk(4, dim=1)  # input, forget, candidate, output: (B*G, H) each
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)  # (B*G, H): c_t
        h = torch.sigmoid(o) * torch.tanh(c)  # (B*G, H): h_t
        return z, alpha, beta, where, (h, c)

    def compile_step(self) -> None:
        """torch.compile `recur` (attention + LSTM cell), the part of the one step that teacher forcing, every
        search, sampling and explain run: the one place compilation is switched on (train.compile, benchmark
        --compile)."""
        self.recur = torch.compile(self.recur)  # type: ignore[method-assign]

    def output(self, emb: torch.Tensor, h: torch.Tensor, z: torch.Tensor, literal: bool = False) -> torch.Tensor:
        """Deep output layer (eq. 7): emb (N, E) = E y_{t-1}, h (N, H) = h_t, z (N, D) = z_t -> logits (N, V).
        Nothing feeds back into the recurrence, so training computes it for all steps at once. literal: plain
        products (the test oracle)."""
        out = torch.tanh(emb + self.out_hidden(h, literal) + self.out_context(z, literal))  # (N, E)
        return self.out_vocab(self.dropout(out), literal)  # (N, V): L_o

    def step(self, state: State, emb: torch.Tensor, emb_gates: torch.Tensor, feats: torch.Tensor,
             feat_proj: torch.Tensor, context: str = "expected", ctx_gates: torch.Tensor | None = None,
             literal: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, State]:
        """One word: recur then output. emb (B*G, E), emb_gates (B*G, 4H) from `embed`, the rest as in
        `recur` -> logits (B*G, V), alpha (B*G, P), beta (B*G,), new state. context: how a hard model
        attends (decode.hard_context, or "sample"); a soft model always uses the expected context."""
        if literal:  # the oracle: W_e E y by a plain product, never the word-gate table
            emb_gates = F.linear(emb, self.gates_embed.weight, self.gates_embed.bias)  # (B*G, 4H)
        z, alpha, beta, _, state = self.recur(state, emb_gates, feats, feat_proj, context if self.hard else "expected",
                                              ctx_gates, literal)
        return self.output(emb, state[0], z, literal), alpha, beta, state

    def teacher_force(self, feats: torch.Tensor, inputs: torch.Tensor, lengths: torch.Tensor,
                      image_index: torch.Tensor | None = None, context: str = "expected") -> TeacherForced:
        """Teacher forcing: the one entry used by training, grounding and explaining a sentence.

        feats (Bi, P, D) per image; inputs (B, T) = <start> w_1 .. w_{T-1} per caption, padded;
        lengths (B,) = number of predicted tokens per caption (words + <end>), SORTED descending;
        image_index (B,) maps each caption to its image (several captions share one image and one
        W_a a_i projection). Returns logits (B, T, V), alphas (B, T, P) and betas (B, T), zero where t >= length:
        padded positions are never computed, the batch shrinks as captions finish. The recurrence
        runs step by step (it must); the deep output runs once over all real tokens, and the
        padded results are assembled with one scatter (writing each step into a preallocated
        buffer would make autograd copy the whole buffer once per step).

        context "sample" (hard attention, eq. 8): each word attends to one sampled location; loc_logp
        is then sum_t log alpha_t[s_t] per caption (B,) over its real steps, the log
        p(s) of the REINFORCE term (eq. 12); None for the expected context.
        """
        if context != "expected" and not self.hard:
            raise ValueError(f"context '{context}' needs a hard-attention decoder (model.attention=hard)")
        B, T = inputs.shape
        if image_index is None:
            image_index = torch.arange(B, device=feats.device)
        if bool((lengths[1:] > lengths[:-1]).any()):
            raise ValueError("lengths must be sorted in descending order")
        feat_proj = self.attention.project(feats).index_select(0, image_index)  # (B, P, A): once per image, shared
        # W_z a_i once per image for a few sentences without autograd (explain): their steps would read all of W_z
        # for a row or two; many rows a step (validation) or autograd (training): the product, cheaper there
        few = not torch.is_grad_enabled() and B <= FEW_SENTENCES
        ctx_gates = self.context_gates(feats).index_select(0, image_index) if few else None  # (B, P, 4H)
        feats = feats.index_select(0, image_index)  # (B, P, D); not feats[image_index], whose gradient sums a
        # shared image's captions by racing atomic adds at 2+ threads (index_select's sums them in one order)
        h, c = self.init_state(feats)
        emb, emb_gates = self.embed(inputs)  # (B, T, E), (B, T, 4H): all steps in one product
        n_active = (lengths.unsqueeze(0) > torch.arange(T, device=lengths.device).unsqueeze(1)).sum(1).tolist()
        hs, zs, alphas_t, betas_t, loc_logps = [], [], [], [], []
        for t in range(T):
            n = n_active[t]
            if n == 0:
                break
            z, alpha, beta, where, (h, c) = self.recur((h[:n], c[:n]), emb_gates[:n, t], feats[:n], feat_proj[:n],
                                                       context, None if ctx_gates is None else ctx_gates[:n])
            hs.append(h)
            zs.append(z)
            alphas_t.append(alpha)
            betas_t.append(beta)
            if where is not None:  # log alpha_t[s_t]; alpha of a sampled location is > 0
                loc_logps.append(alpha.gather(1, where.unsqueeze(1)).squeeze(1).float().log())  # (n,)
        return self._padded(B, T, n_active, emb, hs, zs, alphas_t, betas_t, loc_logps)

    def teacher_force_static(self, feats: torch.Tensor, inputs: torch.Tensor, lengths: torch.Tensor,
                             image_index: torch.Tensor) -> TeacherForced:
        """Teacher forcing at a fixed shape, for a recorded training step (training/captured_step.py): every caption
        runs all T steps and what lies past its length is masked, so no shape and no branch depends on the
        lengths' values (teacher_force reads them to shrink the batch as captions end, which a recording cannot
        hold). The same arguments and results as teacher_force (soft attention): zero where t >= length. Lengths
        need no order. The steps past a caption's end cost work that teacher_force skips; on a GPU at training's
        small batches the launches, not that work, set the time."""
        B, T = inputs.shape
        feat_proj = self.attention.project(feats).index_select(0, image_index)  # (B, P, A)
        feats = feats.index_select(0, image_index)  # (B, P, D)
        state = self.init_state(feats)
        emb, emb_gates = self.embed(inputs)  # (B, T, E), (B, T, 4H)
        hs, zs, alphas, betas = [], [], [], []
        for t in range(T):
            z, alpha, beta, _, state = self.recur(state, emb_gates[:, t], feats, feat_proj)
            hs.append(state[0])
            zs.append(z)
            alphas.append(alpha)
            betas.append(beta)
        live = torch.arange(T, device=inputs.device).unsqueeze(0) < lengths.unsqueeze(1)  # (B, T)
        logits = self.output(emb, torch.stack(hs, 1), torch.stack(zs, 1))  # (B, T, V): eq. 7 for every step
        alphas_, betas_ = torch.stack(alphas, 1), torch.stack(betas, 1)  # (B, T, P), (B, T)
        return TeacherForced(logits * live.unsqueeze(2).to(logits.dtype), alphas_ * live.unsqueeze(2).to(alphas_.dtype),
                             betas_ * live.to(betas_.dtype), None)

    def _padded(self, B: int, T: int, n_active: list[int], emb: torch.Tensor, hs: list[torch.Tensor],
                zs: list[torch.Tensor], alphas_t: list[torch.Tensor], betas_t: list[torch.Tensor],
                loc_logps: list[torch.Tensor]) -> TeacherForced:
        """teacher_force's steps, each over its n_active[t] live captions, as (B, T, ...) tensors zero where t >=
        length: the deep output (eq. 7) once over every real token, then one scatter per result."""
        # real tokens in time-major order: (caption, step) of each packed row
        rows = torch.cat([torch.arange(n, device=emb.device) for n in n_active if n])  # (N,)
        steps = torch.cat([torch.full((n,), t, device=emb.device) for t, n in enumerate(n_active) if n])
        logits = self.output(emb[rows, steps], torch.cat(hs), torch.cat(zs))  # (N, V): eq. 7 for every token
        padded = logits.new_zeros(B, T, self.vocab_size).index_put((rows, steps), logits)  # (B, T, V)
        alphas = torch.cat(alphas_t)
        alphas = alphas.new_zeros(B, T, alphas.shape[1]).index_put((rows, steps), alphas)  # (B, T, P)
        betas = torch.cat(betas_t)
        betas = betas.new_zeros(B, T).index_put((rows, steps), betas)  # (B, T)
        loc_logp = None
        if loc_logps:
            lp = torch.cat(loc_logps)  # (N,) time-major, like `rows`
            loc_logp = lp.new_zeros(B).index_add(0, rows, lp)  # (B,): sum over each caption's real steps
        return TeacherForced(padded, alphas, betas, loc_logp)
