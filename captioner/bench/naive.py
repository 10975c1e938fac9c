"""The textbook loops the benchmark compares against: the model's reference step (model/decoder.py,
model/attention.py: the paper's equations with plain products) run as textbook loops run it. Nothing is
patched: these call the reference Decoder's own methods; the fast path is model/fast.py.

- ReferenceSteps(decoder): greedy/beam search (decoding/search.py) through Decoder.step itself: eq. 4
  with tanh, W_z z_t and W_e E y multiplied at every step, and W_a a_i recomputed at every step
  (nothing cached per image). The same numbers as the fast path to float rounding.
- naive_decoder(decoder): its ReferenceSteps (beam search "naive"); the decoder is shared, not copied.
- naive_loss: teacher forcing as a loop over Decoder.step at every padded position (all captions run
  T steps, W_a a_i recomputed per step, the deep output per step); padding is masked out of the loss.
"""
from __future__ import annotations

import torch

from ..config import Config
from ..model.decoder import Decoder, State
from ..model.fast import Steps
from ..training.loss import LossTerms, caption_loss


def _nothing(feats: torch.Tensor) -> torch.Tensor:
    """feats (B, P, D) -> (B, P, 0): nothing cached per image (search subsets it with the images)."""
    return feats[..., :0]


class _Recomputing:
    """The `attention.project` decoding calls once per image: here nothing, the step projects itself."""
    project = staticmethod(_nothing)


class ReferenceSteps(Steps):
    """Decoding's interface (model/fast.Steps) over the reference Decoder.step."""

    def __init__(self, decoder: Decoder):
        self.decoder, self.hard, self.attention = decoder, decoder.hard, _Recomputing()

    def init_state(self, feats: torch.Tensor) -> State:
        return self.decoder.init_state(feats)

    def embed(self, words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decoder.embed(words)  # W_e E y multiplied at every step

    def context_gates(self, feats: torch.Tensor) -> torch.Tensor:
        return _nothing(feats)  # W_z z_t multiplied at every step instead

    def step(self, state: State, emb: torch.Tensor, emb_gates: torch.Tensor, feats: torch.Tensor,
             feat_proj: torch.Tensor, context: str = "expected", ctx_gates: torch.Tensor | None = None):
        """Decoder.step with W_a a_i projected now (feat_proj and ctx_gates are the empty placeholders)."""
        d = self.decoder
        return d.step(state, emb, emb_gates, feats, d.attention.project(feats), context)


def naive_decoder(decoder: Decoder) -> ReferenceSteps:
    """Beam search's "naive" mode: the reference step, W_a a_i recomputed at every step."""
    return ReferenceSteps(decoder)


def naive_loss(decoder: Decoder, feats: torch.Tensor, batch, cfg: Config) -> LossTerms:
    """The loss of teacher forcing written as a textbook loop: the reference step at every padded position
    of every caption (no shrinking batch), each caption with its own copy of its image's features."""
    T = batch.inputs.shape[1]
    feats = feats[batch.image_index]  # (B, P, D)
    state = decoder.init_state(feats)
    logits, alphas = [], []
    for t in range(T):
        emb, emb_gates = decoder.embed(batch.inputs[:, t])  # (B, E), (B, 4H)
        lg, alpha, _, state = decoder.step(state, emb, emb_gates, feats, decoder.attention.project(feats))
        logits.append(lg)
        alphas.append(alpha)
    valid = torch.arange(T, device=feats.device)[None, :] < batch.lengths[:, None]  # (B, T)
    return caption_loss(torch.stack(logits, 1), torch.stack(alphas, 1) * valid.unsqueeze(-1), batch.targets,
                        batch.lengths, cfg.train.alpha_c, cfg.train.label_smoothing)
