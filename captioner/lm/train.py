"""Training the concept language model (language_model.py) on text (lm_data.py): Adam, held-out
perplexity after every epoch, the learning rate halved when it stops falling, early stopping, and
the best model written as it appears (so an interrupted run still leaves its best model).

Validation perplexity is measured twice: with the categories each sentence names as the condition
("named": clean multi-hot, what early stopping watches) and with no condition at all ("none"). The
gap between the two is what conditioning buys; a model that ignored its concepts would show none.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from .model import ConceptLM, LMConfig, generate, save_language_model
from .data import Corpus, Encoded, batches, corrupt_concepts, observable_mask
from ..logs import JsonlLogger


@dataclass
class LMTrainSettings:
    embed_dim: int = 256
    hidden_dim: int = 384  # 512 costs ~1.5x the time per epoch on one CPU thread
    num_layers: int = 1
    dropout: float = 0.3
    epochs: int = 8
    batch_size: int = 64
    lr: float = 2e-3
    grad_clip: float = 1.0
    patience: int = 2  # epochs without a better validation perplexity before stopping
    concept_drop: float = 0.3  # lm_data.corrupt_concepts
    distractors: float = 2.0
    low: float = 0.3
    seed: int = 0
    log_every: int = 200  # steps between progress lines
    half: bool = True  # store float16 weights
    max_minutes: float = 0.0  # > 0: start no epoch after this much training time


@torch.no_grad()
def perplexity(lm: ConceptLM, data: Encoded, condition: str = "named", batch_size: int = 256) -> float:
    """exp(mean NLL per predicted token, <end> included) of `data`; condition "named": each sentence's
    named categories, "none": an all-zero concept vector."""
    was_training = lm.training
    lm.eval()
    total, count = 0.0, 0
    for inputs, targets, concepts in batches(data, batch_size):
        if condition == "none":
            concepts = torch.zeros_like(concepts)
        nll, n = lm.nll(inputs, targets, concepts)
        total, count = total + float(nll), count + n
    lm.train(was_training)
    return math.exp(total / max(count, 1))


def train_one_epoch(lm: ConceptLM, opt: torch.optim.Optimizer, data: Encoded, s: LMTrainSettings,
                    gen: torch.Generator, log: Callable[[str], None], epoch: int) -> dict[str, float]:
    """One pass over `data` in random length-grouped batches with freshly corrupted concepts."""
    lm.train()
    observable = observable_mask(lm.categories)
    t0, total, count, n_batches = time.perf_counter(), 0.0, 0, math.ceil(len(data) / s.batch_size)
    for step, (inputs, targets, named) in enumerate(batches(data, s.batch_size, gen), 1):
        concepts = corrupt_concepts(named, observable, s.concept_drop, s.distractors, s.low, gen)  # (B, C)
        nll, n = lm.nll(inputs, targets, concepts)
        opt.zero_grad(set_to_none=True)
        (nll / n).backward()
        torch.nn.utils.clip_grad_norm_(lm.parameters(), s.grad_clip)
        opt.step()
        total, count = total + float(nll.detach()), count + n
        if step % s.log_every == 0 or step == n_batches:
            el = time.perf_counter() - t0
            log(f"epoch {epoch} step {step}/{n_batches}  train ppl {math.exp(total / count):.1f}  "
                f"{count / el:.0f} tok/s  {el:.0f}s")
    return {"train_ppl": math.exp(total / max(count, 1)), "seconds": time.perf_counter() - t0}


def build_lm(corpus: Corpus, captioner_vocab_size: int, categories: Sequence[str], s: LMTrainSettings) -> ConceptLM:
    config = LMConfig(len(corpus.vocab), captioner_vocab_size, len(categories), s.embed_dim, s.hidden_dim,
                      s.num_layers, s.dropout)
    return ConceptLM(config, corpus.vocab, categories)


def fit(lm: ConceptLM, corpus: Corpus, s: LMTrainSettings, out: str | Path, log: Callable[[str], None] = print,
        jsonl: JsonlLogger | None = None) -> dict[str, float]:
    """Train until `s.epochs`, `s.patience` epochs without progress, or `s.max_minutes`; the best model
    (by validation perplexity with named concepts) is saved to `out` whenever it improves. Returns the
    best epoch's record."""
    torch.manual_seed(s.seed)
    gen = torch.Generator().manual_seed(s.seed)
    opt = torch.optim.Adam(lm.parameters(), lr=s.lr)
    best: dict[str, float] = {"val_ppl": float("inf")}
    bad, t_start = 0, time.perf_counter()
    for epoch in range(1, s.epochs + 1):
        rec = {"kind": "val", "epoch": epoch, **train_one_epoch(lm, opt, corpus.train, s, gen, log, epoch)}
        rec.update(val_ppl=perplexity(lm, corpus.val, "named"), val_ppl_no_concepts=perplexity(lm, corpus.val, "none"),
                   lr=opt.param_groups[0]["lr"])
        log(f"epoch {epoch}: train ppl {rec['train_ppl']:.2f}  val ppl {rec['val_ppl']:.2f} (no concepts "
            f"{rec['val_ppl_no_concepts']:.2f})  {rec['seconds']:.0f}s  lr {rec['lr']:g}")
        if jsonl is not None:
            jsonl.write(rec)
        if rec["val_ppl"] < best["val_ppl"]:
            best, bad = rec, 0
            save_language_model(lm, out, half=s.half, metrics={**rec, "settings": asdict(s)})
            log(f"saved {out}")
        else:
            bad += 1
            for g in opt.param_groups:
                g["lr"] /= 2
            if bad >= s.patience:
                log(f"early stop: {bad} epochs without a better validation perplexity")
                break
        if s.max_minutes and time.perf_counter() - t_start > 60 * s.max_minutes:
            log(f"time limit of {s.max_minutes} minutes reached")
            break
    return best


# ---------------------------------------------------------------- looking at what it learnt

def concept_vector(names: Sequence[str], categories: Sequence[str]) -> torch.Tensor:
    """Category names -> (C,) with 1 at those categories (ValueError for an unknown name)."""
    out = torch.zeros(len(categories))
    for n in names:
        if n not in categories:
            raise ValueError(f"unknown category {n!r}; categories are {', '.join(categories)}")
        out[list(categories).index(n)] = 1.0
    return out


@torch.no_grad()
def next_word_logprob(lm: ConceptLM, prefix: Sequence[str], word: str, concepts: torch.Tensor) -> float:
    """log p(word | <start> prefix, concepts (C,)) under the LM (eval mode)."""
    v = lm.vocab
    state = lm.start(concepts.unsqueeze(0))
    for w in [v.itos[v.start]] + list(prefix):
        logp, state = lm.step(state, torch.tensor([v.stoi.get(w, v.unk)]))
    return float(logp[0, v.stoi.get(word, v.unk)])


def describe(lm: ConceptLM, concept_sets: Sequence[Sequence[str]], samples: int = 3, seed: int = 0) -> list[str]:
    """Lines: for each concept set, the greedy sentence and `samples` sampled ones (temperature 1)."""
    lm.eval()
    gen, lines = torch.Generator().manual_seed(seed), []
    for names in concept_sets:
        x = concept_vector(names, lm.categories).unsqueeze(0)  # (1, C)
        greedy = generate(lm, x)[0]
        sampled = generate(lm, x.expand(samples, -1), temperature=1.0, generator=gen)
        lines.append(f"{{{', '.join(names)}}}  greedy: {' '.join(greedy)}")
        lines += [f"    sample: {' '.join(s)}" for s in sampled]
    return lines
