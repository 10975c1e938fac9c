"""The whole model: encoder + decoder, built from a ModelConfig."""
from __future__ import annotations

import torch
import torch.nn as nn

from ..config import ModelConfig, check_grid
from .decoder import Decoder
from .encoder import Encoder
from .packed_linear import prepare


class ShowAttendTell(nn.Module):
    def __init__(self, encoder: Encoder, decoder: Decoder):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        return self.encoder(images)  # (B, P, D)

    @torch.no_grad()
    def prepare(self) -> "ShowAttendTell":
        """What inference reads besides the weights, made from them in one step: the packed copies of the step's
        linear layers and of the encoder's 1x1 convolutions (packed_linear.prepare), the encoder's other
        convolutions with their batch norms folded in (Encoder.fold) and the word-gate table
        (Decoder.make_word_gates). A Captioner calls it at load and training before each validation; each copy
        also checks its weights' version and address, so one changed or moved since is made again, never read
        stale."""
        prepare(self.decoder, self.encoder.pointwise_layers())
        self.encoder.fold()
        self.decoder.make_word_gates()
        return self


def build_model(cfg: ModelConfig, vocab_size: int, pretrained: bool | None = None) -> ShowAttendTell:
    """pretrained=None follows cfg.pretrained; loading a checkpoint passes False (its weights win)."""
    pretrained = cfg.pretrained if pretrained is None else pretrained
    check_grid(cfg, "model config")  # never average-pool a feature map UP to a larger grid
    encoder = Encoder(cfg.encoder, pretrained, cfg.grid_size, cfg.output_stride)
    decoder = Decoder(vocab_size, encoder.out_dim, cfg.embed_dim, cfg.hidden_dim, cfg.attention_dim, cfg.dropout,
                      cfg.attention)
    return ShowAttendTell(encoder, decoder)
