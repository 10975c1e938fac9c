"""Training objectives. Each is a callable of the same shape, objective(model, batch) -> Objective
terms, so the training loop never branches on what it optimises:

- CrossEntropy: teacher forcing, Xu et al. eq. 14 (loss.py): cross-entropy + lambda * doubly
  stochastic attention penalty. A hard-attention model (model.attention=hard) attends to sampled
  locations and adds the REINFORCE and entropy terms of eq. 12, except on a share of batches
  (train.hard_expected_prob) that use the expected context and the plain loss, as the authors' code does.
- SelfCritical: self-critical sequence training (Rennie et al. 2017) on CIDEr-D. K captions are
  sampled per image; the reward of each is its CIDEr-D against the image's references, the
  baseline is the mean reward of the image's OTHER samples ("new self-critical") or the reward of
  the greedy caption (the original paper); loss = -(r - b) log p(sample), per token, plus the same
  attention penalty on the sampled captions' maps.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from ..decoding.cider import CiderD
from ..concepts.maps import cam_loss, concept_maps, head_kl
from ..concepts.imagenet import MAP_CATEGORIES, encoder_head
from ..concepts.words import word_categories
from ..config import Config, check_choice
from ..data.dataset import Batch
from ..decoding.rules import unruled
from ..decoding.search import decode
from ..decoding.sampling import sample
from .loss import (attention_entropy, attention_penalty, caption_log_likelihood, caption_loss, hard_attention_terms,
                   update_baseline)
from ..model.show_attend_tell import ShowAttendTell
from ..vocab import FUNCTION_WORDS, SpecialIds, Vocab


@dataclass
class Terms:
    total: torch.Tensor  # what backward() sees
    weight: int  # the objective's divisor (tokens): the batch's share of an accumulated step and of the epoch
    logs: dict[str, float] = field(default_factory=dict)  # per-batch scalars for metrics.jsonl
    grad_norm: Any = 0.0  # the gradients' norm before clipping (engine.train_step sets it; a tensor, read when logged)
    # what each log is a mean over, where that is not `weight`'s tokens (the attention penalty: captions): a step's
    # micro-batches and an epoch's steps are combined by these counts, so an accumulated step logs the large batch's
    counts: dict[str, float] = field(default_factory=dict)

    def count(self, key: str) -> float:
        """How many things log `key` is the mean over (tokens unless `counts` says otherwise)."""
        return self.counts.get(key, self.weight)


def batch_features(model: ShowAttendTell, batch: Batch, cfg: Config) -> torch.Tensor:
    if cfg.from_activations:  # model.tune_stages: cached lower-stage activations through the tuned top stages
        return model.encoder.above_split(batch.visual.contiguous(memory_format=torch.channels_last))  # (Bi, P, D)
    return model.encode(batch.visual) if cfg.encoder_in_loop else batch.visual  # (Bi, P, D)


class EncoderTerms:
    """The terms that read the encoder's ImageNet head (concepts/maps.py), shared by both objectives:
    train.alpha_cam (a concept word's attention -> its class activation map) and train.alpha_head
    (the tuned head's predictions -> the pretrained ones). Both 0: nothing is computed."""

    def __init__(self, cfg: Config, vocab: Vocab | None):
        t = cfg.train
        if t.alpha_cam and vocab is None:
            raise ValueError("train.alpha_cam needs the vocabulary (which words name which category)")
        if t.alpha_head and not cfg.from_activations:
            raise ValueError("train.alpha_head needs model.tune_stages > 0 (the activation cache holds the "
                             "pretrained logits it preserves)")
        self.cfg, self.word_cats = cfg, None
        if t.alpha_cam:  # (V, C+1) over MAP_CATEGORIES; person words only with train.cam_person
            self.word_cats = word_categories(vocab, MAP_CATEGORIES)
            if not t.cam_person:
                self.word_cats[:, MAP_CATEGORIES.index("person")] = 0

    def __call__(self, model: ShowAttendTell, batch: Batch, feats: torch.Tensor, alphas: torch.Tensor | None,
                 n_tokens: int) -> tuple[torch.Tensor, dict[str, float], dict[str, float]]:
        """feats (Bi, P, D); alphas (B, T, P) the teacher-forced attention of the batch's references (None:
        not computed, allowed without alpha_cam); n_tokens: the objective's per-token divisor
        -> (what to add to its total, logs, what each log is a mean over: Terms.counts)."""
        t = self.cfg.train
        total, logs, counts = feats.new_zeros(()).float(), {}, {}
        if not (t.alpha_cam or t.alpha_head):
            return total, logs, counts
        head = encoder_head(model)
        if t.alpha_cam:
            with torch.no_grad():  # the map is the target: the classifier's view, not pulled towards the attention
                maps, probs = concept_maps(head, feats)  # (Bi, C, P), (Bi, C)
            cam, n = cam_loss(alphas, batch.targets, batch.lengths, batch.image_index, maps, probs, self.word_cats,
                              t.cam_min_prob)
            total = total + t.alpha_cam * cam * n / max(n_tokens, 1)  # per token, like the cross-entropy
            logs.update({"cam": cam.item(), "cam_words": n / max(n_tokens, 1)})
            counts.update({"cam": n, "cam_words": n_tokens})  # cam: per supervised word; cam_words: a share of tokens
        if t.alpha_head:
            kl = head_kl(head, feats, batch.teacher_logits)
            total = total + t.alpha_head * kl
            logs["head_kl"], counts["head_kl"] = kl.item(), len(feats)  # per photo
        return total, logs, counts


class CrossEntropy:
    def __init__(self, cfg: Config, vocab: Vocab | None = None):
        t = cfg.train
        if not 0.0 <= t.hard_expected_prob <= 1.0:
            raise ValueError(f"train.hard_expected_prob must be in [0, 1], got {t.hard_expected_prob}")
        if not 0.0 <= t.hard_baseline_decay < 1.0:
            raise ValueError(f"train.hard_baseline_decay must be in [0, 1), got {t.hard_baseline_decay}")
        self.cfg, self.encoder_terms = cfg, EncoderTerms(cfg, vocab)

    def __call__(self, model: ShowAttendTell, batch: Batch) -> Terms:
        t, dec = self.cfg.train, model.decoder
        feats = batch_features(model, batch, self.cfg)
        # hard attention: sampled locations, except on a random share of batches (the authors' semi_sampling_p)
        sampled = dec.hard and float(torch.rand(())) >= t.hard_expected_prob
        logits, alphas, _, loc_logp = dec.teacher_force(feats, batch.inputs, batch.lengths, batch.image_index,
                                                     "sample" if sampled else "expected")
        c = caption_loss(logits, alphas, batch.targets, batch.lengths, t.alpha_c, t.label_smoothing)
        logs = {"xent": c.xent.item(), "penalty": c.penalty.item()}  # xent per token, the penalty per caption
        captions = len(batch.lengths)
        extra, extra_logs, counts = self.encoder_terms(model, batch, feats, alphas, c.n_tokens)
        c.total, logs, counts = c.total + extra, {**logs, **extra_logs}, {"penalty": captions, **counts}
        if not dec.hard:
            return Terms(c.total, c.n_tokens, logs, counts=counts)
        # hard models log the same keys on every batch, so epoch averages are over all batches
        baseline = dec.reinforce_baseline
        logs.update({"sampled": float(sampled), "baseline": baseline.item(), "reinforce": 0.0,
                     "entropy": attention_entropy(alphas.detach()).mean().item()})
        # per caption; the draw and the baseline once per batch
        counts.update({"reinforce": captions, "entropy": captions, "sampled": 1, "baseline": 1})
        if not sampled:  # expected context: the plain soft loss, no REINFORCE term
            return Terms(c.total, c.n_tokens, logs, counts=counts)
        log_lik = caption_log_likelihood(logits, batch.targets, batch.lengths)  # (B,)
        h = hard_attention_terms(log_lik, loc_logp, alphas, baseline, c.n_tokens, t.hard_reinforce, t.hard_entropy)
        logs["reinforce"] = h.reinforce.item()
        total = c.total + h.total  # with the baseline before this batch; then b moves towards this batch's mean
        update_baseline(baseline, log_lik, t.hard_baseline_decay)
        return Terms(total, c.n_tokens, logs, counts=counts)


def mean_of_others(reward: torch.Tensor) -> torch.Tensor:
    """reward (Bi, K) -> (Bi, K): for each sample, the mean reward of its image's K - 1 OTHER samples
    ("new self-critical" baseline: unbiased, since a sample never baselines itself)."""
    K = reward.shape[1]
    return (reward.sum(1, keepdim=True) - reward) / (K - 1)


def batch_references(batch: Batch, end: int) -> list[list[list[int]]]:
    """The reference captions of each image of the batch, as word ids (no <end>)."""
    refs: list[list[list[int]]] = [[] for _ in range(len(batch.visual))]
    for row, img, n in zip(batch.targets.tolist(), batch.image_index.tolist(), batch.lengths.tolist()):
        refs[img].append([w for w in row[:n] if w != end])
    return refs


class SelfCritical:
    def __init__(self, cfg: Config, vocab: Vocab, cider: CiderD):
        t = cfg.train
        if t.scst_samples < 2 and t.scst_baseline == "mean":
            raise ValueError("train.scst_baseline=mean needs train.scst_samples >= 2 (the other samples are the baseline)")
        if t.cpu_amp:  # the backward through the sampled steps is far slower in CPU bf16 (docs/performance.md)
            raise ValueError("train.cpu_amp with train.objective=scst: CPU bf16 autocast makes the backward pass "
                             "through sampled captions ~20x slower; set train.cpu_amp=false")
        check_choice("train.scst_baseline", t.scst_baseline)
        self.cfg, self.vocab, self.cider = cfg, vocab, cider
        if t.alpha_cam and not t.scst_xent:
            raise ValueError("train.alpha_cam with train.objective=scst needs train.scst_xent > 0: the term "
                             "supervises the references' teacher-forced attention")
        self.encoder_terms = EncoderTerms(cfg, vocab)
        self.bad_end = {vocab.stoi[w] for w in FUNCTION_WORDS if w in vocab.stoi}

    def rewards(self, captions: list[list[int]], refs: list[list[list[int]]]) -> torch.Tensor:
        """CIDEr-D of each caption against its references, minus train.scst_bad_ending_penalty for
        a caption that ends in a function word."""
        if self.cfg.train.scst_reward_end:  # <end> is a word: the final n-grams must match a reference's
            e = [self.vocab.end]
            captions, refs = [c + e for c in captions], [[x + e for x in rs] for rs in refs]
        r = torch.tensor(self.cider.score(captions, refs))
        pen = self.cfg.train.scst_bad_ending_penalty
        if pen:
            r -= pen * torch.tensor([float(bool(c) and c[-1] in self.bad_end) for c in captions])
        return r

    def __call__(self, model: ShowAttendTell, batch: Batch) -> Terms:
        t, v = self.cfg.train, self.vocab
        K = t.scst_samples
        feats = batch_features(model, batch, self.cfg)  # (Bi, P, D)
        refs = batch_references(batch, v.end)
        was_training = model.decoder.training
        model.decoder.train(t.scst_dropout)  # without dropout the samples come from the policy decoding uses
        s = sample(model.decoder, feats, SpecialIds.of(v, self.cfg.decode.forbid_unk), K, t.scst_max_len)  # Bi*K rows
        model.decoder.train(was_training)
        reward = self.rewards(s.captions(v.end), [r for r in refs for _ in range(K)]).view(-1, K)  # (Bi, K)
        if t.scst_baseline == "mean":
            baseline = mean_of_others(reward)  # (Bi, K)
        else:
            baseline = self._greedy_reward(model, feats.detach(), refs).unsqueeze(1)  # (Bi, 1)
        adv = (reward - baseline).view(-1).to(s.log_probs.device)  # (Bi*K,)
        n_tokens = int(s.mask.sum())
        pg = -(adv.unsqueeze(1) * s.log_probs).sum() / n_tokens  # per token, like cross-entropy
        penalty = attention_penalty(s.alphas)  # (Bi*K,)
        total = pg + t.alpha_c * penalty.sum() / n_tokens
        logs = {"reward": reward.mean().item(), "baseline": baseline.mean().item(),
                "sample_len": n_tokens / s.mask.shape[0], "penalty": t.alpha_c * penalty.mean().item()}
        samples = s.mask.shape[0]  # Bi x K: the reward, its baseline, the length and the penalty are per sample
        counts = {"reward": samples, "baseline": samples, "sample_len": samples, "penalty": samples}
        if t.scst_xent:  # mixed objective: the references' likelihood keeps the policy near fluent captions
            logits, alphas, _, _ = model.decoder.teacher_force(feats, batch.inputs, batch.lengths, batch.image_index)
            xent = caption_loss(logits, alphas, batch.targets, batch.lengths, 0.0).xent
            total = total + t.scst_xent * xent
            logs["xent"], counts["xent"] = xent.item(), int(batch.lengths.sum())  # per reference token
            extra, extra_logs, extra_counts = self.encoder_terms(model, batch, feats, alphas, int(batch.lengths.sum()))
        else:  # alpha_cam needs the references' attention (checked in __init__); alpha_head does not
            extra, extra_logs, extra_counts = self.encoder_terms(model, batch, feats, None, n_tokens)
        return Terms(total + extra, n_tokens, {**logs, **extra_logs}, counts={**counts, **extra_counts})

    @torch.no_grad()
    def _greedy_reward(self, model: ShowAttendTell, feats: torch.Tensor, refs: list[list[list[int]]]) -> torch.Tensor:
        was_training = model.decoder.training
        model.decoder.eval()  # the caption the model would write: no dropout
        # the baseline is the policy's own greedy caption (decode's beam 1), under the samples' rules (none:
        # rules.py says which)
        settings = unruled(self.cfg.decode, beam_size=1, max_len=self.cfg.train.scst_max_len)
        hyps = decode(model.decoder, feats, SpecialIds.of(self.vocab, self.cfg.decode.forbid_unk), settings)
        model.decoder.train(was_training)
        return self.rewards([h[0].tokens for h in hyps], refs)


def build_objective(cfg: Config, vocab: Vocab, train_captions: list[list[list[int]]]):
    """train.objective -> the objective; SCST's CIDEr-D takes document frequencies from the training
    captions (encoded, <start>/<end> stripped)."""
    if cfg.train.objective == "xe":
        return CrossEntropy(cfg, vocab)
    if cfg.train.objective == "scst":
        keep_end = cfg.train.scst_reward_end  # document frequencies over the same tokens as the reward
        refs = [[[w for w in c if w != vocab.start and (keep_end or w != vocab.end)] for c in caps]
                for caps in train_captions]
        return SelfCritical(cfg, vocab, CiderD(refs))
    check_choice("train.objective", cfg.train.objective)
    raise AssertionError("unreachable: config.OBJECTIVES and build_objective disagree")
