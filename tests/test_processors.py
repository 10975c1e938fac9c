"""decoding/rules.py: the rules as batched logits processors with a state each row carries equal rules_oracle.word_logp
(the literal oracle, tests/rules_oracle.py) on random histories, rule by rule and all together, with and without the evidence; whole
decodes write the same captions; a step does a fixed number of ops whatever the words written so far."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings as hsettings, strategies as st

from captioner.config import DecodeConfig
from captioner.decoding.rules import RULES, Lexicon, Rules, unruled
from captioner.vocab import SpecialIds

from .rules_oracle import word_logp

START, END, PAD, UNK = 1, 2, 0, 3
V = 14


IDS = SpecialIds(START, END, PAD, UNK)


def _lex(twins: tuple[tuple[int, int], ...]) -> Lexicon:
    """A toy vocabulary: 4 "and" (a joiner), 5 "a" (an article), 6 "the", 7, 8 colours, 9-13 content words."""
    return Lexicon(function_words=(4, 5, 6), bad_last=(4, 5, 6), joiners=(4,), articles=(5, 6), colours=(7, 8),
                   not_after_colour=(10, 11), twins=twins, singular_articles=(5,), plurals=(12, 13),
                   stutters=((9, 10), (9, 11), (5, 13)))


class _Evidence:
    """An Evidence-like table with a veto and a bonus (rules.Evidence's ruled_out and bias_after, without a photo)."""

    def __init__(self, generator: torch.Generator, B: int):
        from captioner.decoding.rules import Evidence

        self.words = (torch.rand(V, 3, generator=generator) < 0.3).float()  # (V, C) 0/1
        self.ruled_out = torch.rand(B, V, generator=generator) < 0.2  # (B, V)
        self.bonus = 3.0 * torch.rand(B, 3, generator=generator)  # (B, C)
        self.has_bonus = True
        self.bias_after = Evidence.bias_after.__get__(self)


def _every_way(draw_rules: list[bool]) -> DecodeConfig:
    return unruled(**dict(zip(RULES, draw_rules)))


TWINS = st.sampled_from([(), ((9, 7),), ((12, 9), (13, 10)), ((12, 9), (13, 9), (11, 4)), ((13, 12), (12, 9))])


@hsettings(max_examples=150, deadline=None)
@given(rows=st.lists(st.lists(st.integers(4, V - 1), min_size=8, max_size=8), min_size=1, max_size=4),
       rules=st.lists(st.booleans(), min_size=5, max_size=5), twins=TWINS, with_evidence=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_each_processor_equals_its_literal_rule_at_every_step(rows, rules, twins, with_evidence, seed):
    """Random histories of up to 8 words, any set of rules (each alone among them), with or without the evidence's
    bonus: at every step the processors' scores with the state advanced word by word are word_logp's, bit for bit."""
    g = torch.Generator().manual_seed(seed)
    ids, lex, settings = IDS, _lex(twins), _every_way(rules)
    tokens = torch.tensor(rows)  # (N, 8)
    images = torch.arange(len(rows)) % 2  # (N,)
    evidence = _Evidence(g, 2) if with_evidence else None
    proc = Rules(ids, settings, evidence, lex)
    state = proc.start(len(rows))
    for t in range(tokens.shape[1] + 1):
        logits = torch.randn(len(rows), V, generator=g)  # (N, V)
        want = word_logp(logits, ids, settings, tokens[:, :t], evidence, images, lex)
        got = proc.scores(logits, tokens[:, :t], state, images)
        assert torch.equal(want, got), (t, rows, settings)
        if t < tokens.shape[1]:
            state = proc.advance(state, tokens[:, t])


@hsettings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(st.integers(4, V - 1), min_size=6, max_size=6), min_size=2, max_size=4),
       order=st.lists(st.integers(0, 3), min_size=1, max_size=6))
def test_the_state_follows_the_rows_the_search_keeps(rows, order):
    """A beam's surviving rows, duplicated and reordered: the state reindexed with them (as the search reindexes its
    tokens) scores as word_logp on the reindexed words."""
    ids, lex, settings = IDS, _lex(((12, 9),)), DecodeConfig()
    settings = dataclasses.replace(settings, evidence=False)
    tokens = torch.tensor(rows)  # (N, 6)
    proc = Rules(ids, settings, lexicon=lex)
    state = proc.start(len(rows))
    for t in range(4):  # each step scored before its words are written, as the searches do
        proc.scores(torch.randn(len(rows), V), tokens[:, :t], state)
        state = proc.advance(state, tokens[:, t])
    proc.scores(torch.randn(len(rows), V), tokens[:, :4], state)
    keep = torch.tensor([k % len(rows) for k in order])  # (M,)
    state = proc.advance(state, tokens[keep, 4], keep)
    logits = torch.randn(len(keep), V)
    assert torch.equal(proc.scores(logits, tokens[keep, :5], state), word_logp(logits, ids, settings, tokens[keep, :5], lexicon=lex))


def test_a_step_costs_the_same_ops_whatever_was_written():
    """A step's ops (scores and the state's update) are the same at every length, fewer than two thirds of the
    literal rules' (which recount every word written), and none reads a tensor back."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from .device_check import NoHostSync

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    ids, lex, every = IDS, _lex(((12, 9),)), DecodeConfig(evidence=False)
    tokens = torch.randint(4, V, (5, 25), generator=torch.Generator().manual_seed(0))
    proc = Rules(ids, every, lexicon=lex)
    counts, literal = [], []
    state = proc.start(5)
    for t in range(25):
        logits = torch.randn(5, V)
        Count.n = 0
        with Count(), NoHostSync():
            proc.scores(logits, tokens[:, :t], state)
            state = proc.advance(state, tokens[:, t], torch.arange(5))
        counts.append(Count.n)
        Count.n = 0
        with Count():
            word_logp(logits, ids, every, tokens[:, :t], lexicon=lex)
        literal.append(Count.n)
    assert len(set(counts[3:])) == 1, counts
    assert 3 * counts[-1] < 2 * literal[-1], (counts, literal)  # the state's update included: under two thirds


def _literal(monkeypatch, ids: SpecialIds, settings: DecodeConfig, evidence, lex: Lexicon) -> None:
    """Every search scores with rules_oracle.word_logp from all the words written (the state ignored)."""
    monkeypatch.setattr(Rules, "scores", lambda self, logits, tokens, state, images=None:
                        word_logp(logits, ids, settings, tokens, evidence, images, lex))
    monkeypatch.setattr(Rules, "advance", lambda self, state, words, rows=None: state)


@pytest.mark.parametrize("search", ["greedy", "beam", "device_beam"])
def test_whole_decodes_write_the_same_captions(monkeypatch, search):
    """A random decoder, every rule and the evidence's bonus: greedy (beam 1), beam and the fixed-shape beam search find the
    same hypotheses (words, scores, word log-probs) with the processors as with the literal rules."""
    from captioner.decoding.device_beam import beam_search_on_device
    from dataclasses import replace

    from captioner.decoding.search import beam_search
    from captioner.model.decoder import Decoder

    torch.manual_seed(0)
    dec = Decoder(V, 16, 12, 20, 10, 0.0).eval()
    feats = torch.rand(3, 9, 16)
    ids, lex = IDS, _lex(((12, 9), (13, 10)))
    evidence = _Evidence(torch.Generator().manual_seed(1), 3)
    settings = DecodeConfig(beam_size=3, max_len=10, evidence=False)
    rules = lambda: Rules(ids, settings, evidence, lex)  # noqa: E731
    run = {"greedy": lambda: beam_search(dec, feats, ids, replace(settings, beam_size=1), rules()),
           "beam": lambda: beam_search(dec, feats, ids, settings, rules()),
           "device_beam": lambda: beam_search_on_device(dec, feats, ids, settings, rules())}[search]
    got = run()
    _literal(monkeypatch, ids, settings, evidence, lex)
    want = run()
    assert [[h.tokens for h in hs] for hs in got] == [[h.tokens for h in hs] for hs in want]
    assert sum(len(h.tokens) for hs in got for h in hs) > 6  # real captions were written
    for hs, ws in zip(got, want):
        for h, w in zip(hs, ws):
            assert h.score == w.score and h.log_prob == w.log_prob and torch.equal(h.word_logps, w.word_logps)
