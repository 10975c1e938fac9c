"""The new words of an extended vocabulary (train.extend_vocab): where they start, how fast they move, and
how validation sees them.

- Grow (grow_vocabulary): a model file's weights grown to the extended vocabulary, old words first with the ids
  they had (Vocab.extended), so before any training the extended model gives every old word the logit it had. A
  new word starts as the average old word: its embedding the old embeddings' mean plus a little seeded noise (two
  new words must not be interchangeable to the LSTM), its output row the old rows' mean, its output bias the
  lowest old bias, so no new word starts out more likely than the rarest old one.
- Start (init_from_substitutes): grow_vocabulary's average rows first; then each new word
  takes the rows (embedding, output row and bias) of the old word the starting model predicts where the
  training captions have the new word, teacher-forced ("stallion" starts as "horse"). Before any step the
  model already places the new word where it belongs, ahead of the old one as far as the captions use it in
  the old one's place, the pair no likelier than the old word was (share_bias).
  The vocabulary records the pair (Vocab.aliases, saved with the model): a caption that says one of them does
  not say the other too ("a man riding a horse on a stallion": decode.block_content_repeats).
- Speed (NewWordRows, train.new_words_lr_factor): Adam's step on the new words' rows is multiplied by a
  factor, the rest of the model keeps train.lr (what it knew stays); with train.new_words_only the rest does
  not move at all (the own-photos recipe: photos without the new words keep the starting model's captions).
- Validation (new_word_scores): on the val photos, how often the decoded captions use each new word where
  the references use it (recall) and where they do not (false uses); the val metric
  "CIDEr_new_words" is CIDEr plus the mean F1 of those uses.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Any, Callable, Sequence

import torch

from ..vocab import COLOUR_WORDS, FUNCTION_WORDS, SPECIALS, Vocab, tokenize

NEW_WORDS_METRIC = "CIDEr_new_words"  # a train.val_metric: CIDEr + mean F1 of the new words' use on val
GROWN_ROWS = ("embedding.weight", "out_vocab.weight", "out_vocab.bias")  # the decoder's (V, ...) tensors
MIN_VOTES = 5  # a new word takes an old word's rows only from this many positions on, where that word wins most


@torch.no_grad()
def substitutes(decoder: torch.nn.Module, dataset: Any, collate: Callable, features: Callable, old_size: int,
                device: torch.device, batch_images: int = 16) -> tuple[dict[int, Counter], Counter]:
    """(new word id -> Counter of the old word ids the decoder predicts (teacher-forced, its argmax over the
    old words) at the training captions' positions whose target is that new word, Counter of the old word ids
    the training captions themselves say)."""
    votes: dict[int, Counter] = {}
    said: Counter = Counter()
    was_training = decoder.training
    decoder.eval()
    for k in range(0, len(dataset), batch_images):
        batch = collate([dataset[i] for i in range(k, min(k + batch_images, len(dataset)))]).to(device)
        logits = decoder.teacher_force(features(batch), batch.inputs, batch.lengths, batch.image_index)[0]  # (B, T, V)
        is_new = batch.targets >= old_size  # (B, T)
        said.update(batch.targets[(batch.targets >= len(SPECIALS)) & ~is_new].tolist())
        if is_new.any():
            guess = logits[..., len(SPECIALS):old_size].argmax(-1) + len(SPECIALS)  # (B, T) best old word
            for t, g in zip(batch.targets[is_new].tolist(), guess[is_new].tolist()):
                votes.setdefault(t, Counter())[g] += 1
    decoder.train(was_training)
    return votes, said


@torch.no_grad()
def init_from_substitutes(decoder: torch.nn.Module, votes: dict[int, Counter], vocab: Vocab,
                          said: Counter | None = None) -> list[str]:
    """Copy each new word's most voted old word's rows onto its own -> one line per new word for the log.
    Only with evidence: at least MIN_VOTES positions, the old word more than half of them, and a content word
    (a new word copied from "in" or "red" would be said for it everywhere); otherwise the new word keeps
    grow_vocabulary's average start (never more likely than the rarest old word) and learns from there.
    The pair then shares the old word's probability as the captions do (share_bias): the new word is ahead
    where the captions say it in the old word's place, and the two together are no likelier than the old word."""
    rows, said = dict(decoder.named_parameters()), said or Counter()
    bias = rows["out_vocab.bias"].detach().clone()  # (V,) before any pair shares it
    lines, kept = [], []
    for new, counts in sorted(votes.items()):
        old, n = counts.most_common(1)[0]
        total = sum(counts.values())
        if total < MIN_VOTES or 2 * n <= total or vocab.itos[old] in FUNCTION_WORDS | COLOUR_WORDS:
            kept.append(vocab.itos[new])
            continue
        for name in GROWN_ROWS:
            rows[name][new] = rows[name][old]
        share = share_bias(rows["out_vocab.bias"], new, old, bias[old], n, said[old])
        vocab.alias(vocab.itos[new], vocab.itos[old])  # saved with the model: the two are one thing (rules.py)
        lines.append(f"{vocab.itos[new]} <- {vocab.itos[old]} ({n} of {total} positions; your captions say "
                     f"{vocab.itos[old]} {said[old]} times: {vocab.itos[new]} takes {share:.0%} of its probability)")
    if kept:
        lines.append(f"the average start (too few or mixed positions): {', '.join(kept)}")
    return lines


@torch.no_grad()
def share_bias(out_bias: torch.Tensor, new: int, old: int, old_bias: torch.Tensor, n_new: int, n_old: int) -> float:
    """Split the old word's probability between it and its new twin (same rows otherwise) in the proportion
    (n_new + 1) : (n_old + 1) of the captions' uses: exp(b_new) + exp(b_old) = exp(old_bias). An exact copy
    was a tie that beam search broke by word order (the warm start said the old word on most photos) and
    doubled the pair's probability (the thing said where it is not) -> the new word's share."""
    share = (n_new + 1) / (n_new + n_old + 2)
    out_bias[new] = old_bias + math.log(share)
    out_bias[old] = old_bias + math.log(1 - share)
    return share


class NewWordRows:
    """Optimizer hooks that multiply Adam's update of the new words' rows (ids >= old_size) by `factor`:
    the rows are read before each step and moved `factor` times as far after it. With `only`
    (train.new_words_only) nothing else moves: the decoder's other weights take no gradient and the old words'
    rows are put back after each step, so the taught model scores every old word exactly as the starting model
    did (a photo without the new words gets the starting model's caption, bar the new words' share of each
    softmax) and its fp16 export rounds them to the starting file's very values."""

    def __init__(self, optimizer: torch.optim.Optimizer, decoder: torch.nn.Module, old_size: int, factor: float,
                 only: bool = False):
        self.params = [p for name, p in decoder.named_parameters() if name in GROWN_ROWS]
        self.old_size, self.factor = old_size, factor
        self.before: list[torch.Tensor] = []
        self.kept = [p[:old_size].detach().clone() for p in self.params] if only else []  # the old words' rows
        if only:
            for name, p in decoder.named_parameters():
                p.requires_grad_(name in GROWN_ROWS)
        optimizer.register_step_pre_hook(self._pre)
        optimizer.register_step_post_hook(self._post)

    @torch.no_grad()
    def _pre(self, *_):
        self.before = [p[self.old_size:].clone() for p in self.params]

    @torch.no_grad()
    def _post(self, *_):
        for p, b in zip(self.params, self.before):
            p[self.old_size:] = b + self.factor * (p[self.old_size:] - b)
        for p, k in zip(self.params, self.kept):
            p[:self.old_size] = k


def new_word_scores(new_words: Sequence[str], preds: dict[str, str], records: Sequence[Any]
                    ) -> tuple[dict[str, float], str]:
    """Decoded val captions (image_id -> text) against their records' references -> (scores: new_words_recall,
    new_words_precision, new_words_F1, means over the new words some val reference uses; the log line:
    "<word> used in k of n captions whose references use it, and in m of the o others" per word)."""
    said = {r.image_id: set(tokenize(preds[r.image_id])) for r in records if r.image_id in preds}
    recalls, precisions, f1s, parts, unseen = [], [], [], [], 0
    for w in new_words:
        use = [r.image_id in said and any(w in tokenize(c) for c in r.captions) for r in records]
        hits = [w in said.get(r.image_id, ()) for r in records]
        n, k = sum(use), sum(h and u for h, u in zip(hits, use))
        m, o = sum(h and not u for h, u in zip(hits, use)), len(said) - sum(use)
        if not (n or m):  # no val photo to tell: counted, not listed
            unseen += 1
            continue
        parts.append(f"{w} used in {k} of {n} captions whose references use it, and in {m} of the {o} others")
        if n:
            r, p = k / n, k / (k + m) if k + m else 0.0
            recalls.append(r)
            precisions.append(p)
            f1s.append(2 * p * r / (p + r) if p + r else 0.0)
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    scores = {"new_words_recall": mean(recalls), "new_words_precision": mean(precisions), "new_words_F1": mean(f1s)}
    rest = f"{unseen} other new word(s) neither in a val reference nor said" if unseen else ""
    return scores, "new words on val: " + "; ".join(parts + [rest] * bool(rest))


# ---------------------------------------------------------------- the weights grown to the new vocabulary

GROWN = tuple(f"decoder.{k}" for k in GROWN_ROWS)  # the same tensors, as a model file names them


def grow_vocabulary(weights: dict[str, torch.Tensor], new_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """`weights` (a model file's tensors) with the vocabulary-sized tensors grown to `new_size` rows."""
    old_size = weights["decoder.embedding.weight"].shape[0]
    if new_size < old_size:
        raise ValueError(f"the extended vocabulary ({new_size}) is smaller than the model's ({old_size})")
    if new_size == old_size:
        return dict(weights)
    n, words = new_size - old_size, slice(len(SPECIALS), old_size)  # the specials are not words to average
    gen = torch.Generator().manual_seed(seed)
    out = dict(weights)
    emb = weights["decoder.embedding.weight"].float()  # (V, E)
    noise = torch.randn(n, emb.shape[1], generator=gen) * emb[words].std(0) * 0.1  # (n, E)
    out["decoder.embedding.weight"] = _cat(emb, emb[words].mean(0).expand(n, -1) + noise, weights, GROWN[0])
    w = weights["decoder.out_vocab.weight"].float()  # (V, E)
    out["decoder.out_vocab.weight"] = _cat(w, w[words].mean(0).expand(n, -1), weights, GROWN[1])
    b = weights["decoder.out_vocab.bias"].float()  # (V,)
    out["decoder.out_vocab.bias"] = _cat(b, b[words].min().expand(n), weights, GROWN[2])
    return out


def _cat(old: torch.Tensor, rows: torch.Tensor, weights: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    return torch.cat([old, rows]).to(weights[key].dtype)
