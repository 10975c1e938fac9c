"""The textbook loops the benchmark compares against: the model's one step (model/decoder.py) with eq. 4
as the paper writes it (`literal=True`: tanh, one (N, P, A) temporary) and no table, run as textbook loops
run it. Nothing is patched: these call the Decoder's own methods.

- ReferenceSteps(decoder): greedy/beam search (decoding/search.py) through Decoder.step(literal=True):
  W_z z_t and W_e E y multiplied at every step, and W_a a_i recomputed at every step (nothing cached per
  image). The same numbers as the product's step to float rounding (tests/test_fast_decoding.py).
- naive_decoder(decoder): its ReferenceSteps (beam search "naive"); the decoder is shared, not copied.
- naive_loss: teacher forcing as a loop over Decoder.step at every padded position (all captions run
  T steps, W_a a_i recomputed per step, the deep output per step); padding is masked out of the loss.
"""
from __future__ import annotations

import torch

from ..config import Config
from ..model.decoder import Decoder, State
from ..training.loss import LossTerms, caption_loss


def _nothing(feats: torch.Tensor) -> torch.Tensor:
    """feats (B, P, D) -> (B, P, 0): nothing cached per image (search subsets it with the images)."""
    return feats[..., :0]


class _Recomputing:
    """The `AdditiveAttention.project` decoding calls once per image: here nothing, the step projects itself."""
    project = staticmethod(_nothing)


class ReferenceSteps:
    """What decoding calls on a Decoder (attention.project, context_gates, init_state, embed, step), answered
    by its step with eq. 4 as written and every product made at every step."""

    def __init__(self, decoder: Decoder):
        self.decoder, self.hard, self.attention = decoder, decoder.hard, _Recomputing()

    def init_state(self, feats: torch.Tensor) -> State:
        return self.decoder.init_state(feats)

    def embed(self, words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        emb = self.decoder.embedding(words)  # (N, E)
        return emb, self.decoder.gates_embed(emb)  # (N, 4H): W_e E y multiplied at every step, no table

    def context_gates(self, feats: torch.Tensor) -> torch.Tensor:
        return _nothing(feats)  # W_z z_t multiplied at every step instead

    def step(self, state: State, emb: torch.Tensor, emb_gates: torch.Tensor, feats: torch.Tensor,
             feat_proj: torch.Tensor, context: str = "expected", ctx_gates: torch.Tensor | None = None):
        """Decoder.step with eq. 4 as written and W_a a_i projected now (feat_proj and ctx_gates are the empty
        placeholders)."""
        d = self.decoder
        return d.step(state, emb, emb_gates, feats, d.attention.project(feats), context, literal=True)


def naive_decoder(decoder: Decoder) -> ReferenceSteps:
    """Beam search's "naive" mode: the literal step (eq. 4 with tanh), W_a a_i recomputed at every step."""
    return ReferenceSteps(decoder)


def naive_loss(decoder: Decoder, feats: torch.Tensor, batch, cfg: Config) -> LossTerms:
    """The loss of teacher forcing written as a textbook loop: the literal step at every padded position
    of every caption (no shrinking batch), each caption with its own copy of its image's features."""
    T = batch.inputs.shape[1]
    feats = feats[batch.image_index]  # (B, P, D)
    state = decoder.init_state(feats)
    logits, alphas = [], []
    for t in range(T):
        emb, emb_gates = decoder.embed(batch.inputs[:, t])  # (B, E), (B, 4H)
        lg, alpha, _, state = decoder.step(state, emb, emb_gates, feats, decoder.attention.project(feats), literal=True)
        logits.append(lg)
        alphas.append(alpha)
    valid = torch.arange(T, device=feats.device)[None, :] < batch.lengths[:, None]  # (B, T)
    return caption_loss(torch.stack(logits, 1), torch.stack(alphas, 1) * valid.unsqueeze(-1), batch.targets,
                        batch.lengths, cfg.train.alpha_c, cfg.train.label_smoothing)
