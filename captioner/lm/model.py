"""A concept-conditioned language model over an extended vocabulary, meant to be fused with the
captioner's word scores in beam search (lm/fusion.py; not wired into decoding yet) to name objects the
captioner never saw in a photo (Hendricks et al. 2016,
"Deep Compositional Captioning"; Venugopalan et al. 2017, "Captioning Images with Diverse Objects").

Legend: B sentences, N rows (in beam search: images x beams), T steps, C concepts (COCO categories,
in the order of `list(CATEGORY_WORDS)`), E embedding, H hidden, L LSTM layers, V the captioner's
vocabulary, X = V_ext the extended vocabulary (X >= V).

Why: the captioner learnt its language from Flickr8k captions alone, so it cannot say "giraffe"
and rarely says "pizza". This model learns language from text only (Flickr8k train captions + COCO
caption text), so it knows those words and which sentences they go in. Its vocabulary is the
captioner's (ids 0..V-1, the same ids) followed by the words of its training text the captioner
lacks (ids V..X-1): fusion (lm_fusion.py) then adds the two models' scores column by column.

Conditioning: `concepts` (N, C) are the chances that each category is in the photo (at training:
the categories the sentence names, corrupted as lm_data.corrupt_concepts explains; at test: an
image classifier's probabilities). They set the LSTM's initial state AND are concatenated to every
step's input: an initial state alone fades after a few words, and the object must still be in mind
when the sentence reaches its noun ("a man holding a slice of ... pizza").

Decoding API. Beam search runs the LM in lockstep with the captioner's decoder, feeding both the
same words (the captioner gets `lm_fusion.captioner_input_ids(words)`):

    state = lm.start(concepts)             # concepts (N, C) -> the state before any word
    logp, state = lm.step(state, words)    # words (N,) ids < X; the first call feeds <start>
                                           # -> logp (N, X) log-probabilities of the next word
    state = lm.select(state, rows)         # rows (N',) long: reorder / repeat / drop rows

The state is a tuple of tensors whose FIRST dimension is the row: (h (N, L, H), c (N, L, H),
concepts (N, C)); `tuple(t[rows] for t in state)` is always valid, which is all `select` does.
Call `lm.eval()` first (load_language_model returns it in eval mode): dropout is on in train mode.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..checkpoint import CheckpointError, _check_tensors_finite, load_model_state, read_safetensors, write_safetensors
from .fusion import captioner_input_ids, fuse_scores
from ..vocab import Vocab

FORMAT = "captioner-language-model/1"
LMState = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # h (N, L, H), c (N, L, H), concepts (N, C)

__all__ = ["ConceptLM", "LMConfig", "LMState", "captioner_input_ids", "extend_vocab", "fuse_scores",
           "generate", "load_language_model", "save_language_model"]


def extend_vocab(base: Vocab, sentences: Sequence[Sequence[str]], min_count: int = 5) -> Vocab:
    """The captioner's vocabulary first (same ids), then the words of `sentences` (tokenised) seen at
    least min_count times that it lacks, by falling count then alphabetically (deterministic ids)."""
    from collections import Counter

    counts = Counter(w for s in sentences for w in s if w not in base.stoi)
    new = sorted((w for w, n in counts.items() if n >= min_count), key=lambda w: (-counts[w], w))
    return Vocab(list(base.itos) + new)


@dataclass
class LMConfig:
    vocab_size: int  # X, the extended vocabulary
    captioner_vocab_size: int  # V: ids below it are the captioner's words, with its ids
    n_concepts: int  # C
    embed_dim: int = 256  # E; also the output layer's width (its weights are the embedding's: tied)
    hidden_dim: int = 512  # H
    num_layers: int = 1  # L
    dropout: float = 0.3


class ConceptLM(nn.Module):
    """LSTM language model conditioned on a concept vector; see the module docstring for the API."""

    def __init__(self, config: LMConfig, vocab: Vocab, categories: Sequence[str]):
        super().__init__()
        if len(vocab) != config.vocab_size or len(categories) != config.n_concepts:
            raise ValueError(f"config says {config.vocab_size} words and {config.n_concepts} concepts; got a vocabulary "
                             f"of {len(vocab)} and {len(categories)} categories")
        if not 0 < config.captioner_vocab_size <= config.vocab_size:
            raise ValueError(f"captioner_vocab_size {config.captioner_vocab_size} must be in 1..{config.vocab_size}")
        self.config, self.vocab, self.categories = config, vocab, list(categories)
        X, C, E, H, L = config.vocab_size, config.n_concepts, config.embed_dim, config.hidden_dim, config.num_layers
        self.embedding = nn.Embedding(X, E, padding_idx=vocab.pad)
        self.init_h, self.init_c = nn.Linear(C, L * H), nn.Linear(C, L * H)
        self.lstm = nn.LSTM(E + C, H, num_layers=L, batch_first=True, dropout=config.dropout if L > 1 else 0.0)
        self.drop = nn.Dropout(config.dropout)
        self.project = nn.Linear(H, E)  # H -> E, then the tied output layer (Press & Wolf 2017)
        self.out_bias = nn.Parameter(torch.zeros(X))
        # small embeddings: they are also the output weights, and N(0, 1) ones would make an untrained
        # model confidently wrong (first loss well above log X) instead of uniform
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        with torch.no_grad():
            self.embedding.weight[vocab.pad].zero_()

    # ------------------------------------------------------------------ decoding API
    def start(self, concepts: torch.Tensor) -> LMState:
        """concepts (N, C) in [0, 1] -> the state before the first word (feed <start> to `step` next)."""
        N, L, H = concepts.shape[0], self.config.num_layers, self.config.hidden_dim
        concepts = concepts.to(self.out_bias.dtype)
        h = torch.tanh(self.init_h(concepts)).view(N, L, H)  # (N, L, H)
        c = self.init_c(concepts).view(N, L, H)  # (N, L, H)
        return h, c, concepts

    def step(self, state: LMState, words: torch.Tensor) -> tuple[torch.Tensor, LMState]:
        """Read one word per row: words (N,) ids < X -> (logp (N, X) float32 over the next word, state)."""
        out, state = self._run(words.unsqueeze(1), state)  # (N, 1, H)
        return torch.log_softmax(self.logits(out[:, 0]).float(), dim=-1), state

    @staticmethod
    def select(state: LMState, rows: torch.Tensor) -> LMState:
        """rows (N',) long -> the state of those rows, in that order (beam search reordering)."""
        return tuple(t.index_select(0, rows) for t in state)  # type: ignore[return-value]

    # ------------------------------------------------------------------ training
    def _run(self, inputs: torch.Tensor, state: LMState) -> tuple[torch.Tensor, LMState]:
        """inputs (N, T) ids -> LSTM outputs (N, T, H) and the state after the last step."""
        h, c, concepts = state
        emb = self.drop(self.embedding(inputs))  # (N, T, E)
        x = torch.cat([emb, concepts.unsqueeze(1).expand(-1, inputs.shape[1], -1)], dim=-1)  # (N, T, E + C)
        out, (h, c) = self.lstm(x, (h.transpose(0, 1).contiguous(), c.transpose(0, 1).contiguous()))
        return out, (h.transpose(0, 1), c.transpose(0, 1), concepts)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """LSTM outputs (..., H) -> next-word logits (..., X)."""
        return F.linear(self.project(self.drop(out)), self.embedding.weight, self.out_bias)

    def forward(self, inputs: torch.Tensor, concepts: torch.Tensor) -> torch.Tensor:
        """Teacher forcing: inputs (B, T) = <start> w1 .. padded, concepts (B, C) -> logits (B, T, X).
        The same LSTM and output layer as `step`, run over all steps at once."""
        out, _ = self._run(inputs, self.start(concepts))
        return self.logits(out)

    def nll(self, inputs: torch.Tensor, targets: torch.Tensor, concepts: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Summed negative log-likelihood of the non-<pad> targets (B, T), and how many there are. The
        output layer (the costliest part) runs only on those positions."""
        out, _ = self._run(inputs, self.start(concepts))  # (B, T, H)
        keep = targets != self.vocab.pad  # (B, T)
        logits = self.logits(out[keep])  # (n, X)
        return F.cross_entropy(logits.float(), targets[keep], reduction="sum"), int(keep.sum())

    def check_compatible(self, captioner_vocab: Vocab) -> None:
        """Raise ValueError unless this LM's first V words are exactly the captioner's vocabulary."""
        V = self.config.captioner_vocab_size
        if len(captioner_vocab) != V or self.vocab.itos[:V] != captioner_vocab.itos:
            raise ValueError(f"the language model extends a {V}-word vocabulary that is not this captioner's "
                             f"({len(captioner_vocab)} words); retrain it with scripts/train_lm.py --captioner <model>")


@torch.no_grad()
def generate(lm: ConceptLM, concepts: torch.Tensor, max_len: int = 20, temperature: float = 0.0,
             generator: torch.Generator | None = None) -> list[list[str]]:
    """concepts (N, C) -> one sentence (words) per row: greedy for temperature 0, else sampled.
    <pad>, <start> and <unk> are never produced. For looking at what the LM says, not for captioning."""
    v, N = lm.vocab, concepts.shape[0]
    state, words = lm.start(concepts), torch.full((N,), v.start, dtype=torch.long, device=concepts.device)
    out: list[list[str]] = [[] for _ in range(N)]
    done = [False] * N
    for _ in range(max_len):
        logp, state = lm.step(state, words)  # (N, X)
        logp[:, [v.pad, v.start, v.unk]] = float("-inf")
        if temperature > 0:
            words = torch.multinomial(torch.softmax(logp / temperature, -1), 1, generator=generator)[:, 0]
        else:
            words = logp.argmax(-1)  # (N,)
        for i, w in enumerate(words.tolist()):
            done[i] = done[i] or w == v.end
            if not done[i]:
                out[i].append(v.itos[w])
        if all(done):
            break
    return out


def save_language_model(lm: ConceptLM, path: str | Path, half: bool = True, metrics: dict | None = None) -> None:
    """safetensors weights (float16 when half: halves the file, log-probs move by ~1e-3) + JSON metadata:
    format tag, config, vocabulary, the concept categories in order, metrics. Written atomically."""
    state = {k: v.detach().cpu() for k, v in lm.state_dict().items()}
    _check_tensors_finite(state, f"refusing to save {path}")
    tensors = {k: (v.half() if half and v.is_floating_point() else v).contiguous() for k, v in state.items()}
    meta = {"format": FORMAT, "config": json.dumps(asdict(lm.config)), "vocab": lm.vocab.to_json(),
            "categories": json.dumps(lm.categories), "metrics": json.dumps(metrics or {})}
    write_safetensors(path, tensors, meta)


def load_language_model(path: str | Path, device: str | torch.device = "cpu") -> ConceptLM:
    """The ConceptLM of a file written by save_language_model, float32, in eval mode. Never unpickles;
    any other file (a captioner checkpoint, a pickle, a truncated copy) is a CheckpointError saying so."""
    tensors, meta = read_safetensors(path)
    if meta.get("format") != FORMAT:
        hint = (" It is a captioner checkpoint, not a language model." if meta.get("format", "").startswith("captioner-")
                else "")
        raise CheckpointError(f"{path}: format tag {meta.get('format')!r}, expected {FORMAT} (a file written by "
                              f"scripts/train_lm.py / save_language_model).{hint}")
    try:
        config = LMConfig(**json.loads(meta["config"]))
        vocab = Vocab.from_json(meta["vocab"])
        categories = json.loads(meta["categories"])
        if not isinstance(categories, list) or not all(isinstance(c, str) for c in categories):
            raise ValueError("categories must be a JSON list of names")
        lm = ConceptLM(config, vocab, categories)
    except KeyError as e:
        raise CheckpointError(f"{path}: corrupt metadata (no {e.args[0]!r} entry)") from None
    except (json.JSONDecodeError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: corrupt metadata ({e})") from None
    load_model_state(lm, tensors, source=str(path))
    return lm.to(device).eval()
