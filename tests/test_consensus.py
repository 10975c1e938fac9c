"""Consensus reranking (captioner/decoding/consensus.py, weighed by decoding/choice.py's choice): invariants of the
rerank, the memory's round trip, and the product path (captioner.load attaches the memory beside the model file;
weight 0 is the beam's own order)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import captioner
from captioner.checkpoint import CheckpointError
from captioner.config import DecodeConfig
from captioner.decoding.confidence import decide
from captioner.decoding.choice import Weights
from captioner.decoding.consensus import ConsensusMemory, memory_path
from captioner.decoding.device_beam import Hypothesis
from captioner.decoding.photo import caption_photos

EXAMPLES = sorted((Path(captioner.__file__).parent / "assets" / "examples").glob("*.jpg"))


def _memory(D: int = 16, seed: int = 0) -> tuple[ConsensusMemory, torch.Tensor]:
    """Three memory photos with random pooled features (M, D) and distinct captions (word ids 4..)."""
    g = torch.Generator().manual_seed(seed)
    pooled = torch.randn(3, D, generator=g)  # (M, D)
    captions = [[[4, 5, 6, 7]], [[8, 9, 10], [8, 9, 11]], [[12, 13, 14, 15, 16]]]
    return ConsensusMemory.build(pooled, captions, vocab_size=20), pooled


def _hyp(tokens: list[int], score: float) -> Hypothesis:
    return Hypothesis(tokens, torch.zeros(len(tokens), 4), score, score)


def rerank(hyps, feats, memory, k: int, weight: float):
    """The choice with only the beam's score and the consensus weighted (1 - weight, weight): the consensus rerank."""
    return [list(d.hyps) for d in decide(hyps, feats, None, memory, None, DecodeConfig(consensus_k=k),
                                         weights=Weights.from_json({"score": 1 - weight, "consensus": weight}))]


def _near(pooled_row: torch.Tensor, P: int = 4) -> torch.Tensor:
    return pooled_row.expand(1, P, -1).clone()  # (1, P, D): every cell the same, so the mean is the row


def test_a_candidate_identical_to_the_nearest_photos_caption_wins_at_weight_one():
    memory, pooled = _memory()
    cands = [_hyp([8, 9, 10, 11], -0.1), _hyp([4, 5, 6, 7], -3.0), _hyp([12, 13], -0.5)]  # beam order: by score
    for photo, want in ((0, [4, 5, 6, 7]), (2, [12, 13])):  # photo 2's caption shares most with [12, 13]
        out = rerank([cands], _near(pooled[photo]), memory, k=1, weight=1.0)[0]
        assert out[0].tokens == want
        assert sorted(map(tuple, (h.tokens for h in out))) == sorted(map(tuple, (h.tokens for h in cands)))


def test_weight_zero_or_no_memory_keeps_the_beams_order():
    memory, pooled = _memory()
    cands = [_hyp([8, 9, 10, 11], -0.1), _hyp([4, 5, 6, 7], -3.0)]
    for mem, w in ((memory, 0.0), (None, 0.7)):
        assert rerank([cands], _near(pooled[0]), mem, k=2, weight=w)[0] == cands


def test_a_small_weight_leaves_a_clear_beam_winner_in_place():
    """(1 - w) * score gap beats w * CIDEr-D when the gap is large: the model's own judgement still counts."""
    memory, pooled = _memory()
    cands = [_hyp([8, 9, 10, 11], -0.1), _hyp([4, 5, 6, 7], -50.0)]
    assert rerank([cands], _near(pooled[0]), memory, k=1, weight=0.1)[0][0].tokens == [8, 9, 10, 11]


def test_nearest_finds_a_memory_photo_from_its_own_features():
    memory, pooled = _memory()
    for j in range(len(pooled)):
        assert int(memory.nearest(_near(pooled[j] * 3.0), k=1)[1][0, 0]) == j  # cosine: the scale does not matter
    with pytest.raises(ValueError, match="captioner-build-consensus"):
        memory.nearest(torch.zeros(1, 4, 7), k=1)


def test_memory_round_trips_through_save_and_load(tmp_path):
    memory, pooled = _memory()
    path = memory_path(tmp_path / "model.safetensors")
    assert path.name == "model.consensus.safetensors"
    memory.save(path)
    back = ConsensusMemory.load(path)
    assert back.vocab_size == memory.vocab_size and len(back) == len(memory)
    assert torch.equal(back.features, memory.features) and back.features.dtype == torch.int8
    assert [back.captions_of(j) for j in range(3)] == [memory.captions_of(j) for j in range(3)]
    assert back.captions_of(0) == ((4, 5, 6, 7),) and back.captions_of(1) == ((8, 9, 10), (8, 9, 11))
    assert back.captions_of(2) == ((12, 13, 14, 15, 16),)
    query = _near(torch.randn(16))
    assert torch.equal(back.nearest(query, 3)[1], memory.nearest(query, 3)[1])
    # the document frequencies are built once per file and process; a rewritten file builds its own
    assert ConsensusMemory.load(path).cider is back.cider and back.cider_to("cpu") is back.cider
    assert torch.equal(back.cider.codes, memory.cider.codes) and torch.equal(back.cider.idf, memory.cider.idf)
    ConsensusMemory.build(torch.randn(2, 16), [[[4, 5]], [[6]]], vocab_size=20).save(path)
    assert ConsensusMemory.load(path).cider is not back.cider


def test_a_file_that_is_not_a_memory_is_refused_with_advice(tmp_path):
    from captioner.checkpoint import write_safetensors

    path = tmp_path / "m.consensus.safetensors"
    write_safetensors(path, {"x": torch.zeros(2)}, {"format": "something-else"})
    with pytest.raises(CheckpointError, match="captioner-build-consensus"):
        ConsensusMemory.load(path)
    with pytest.raises(ValueError, match="at least one caption"):
        ConsensusMemory.build(torch.zeros(2, 4), [[[4]], []], 10)


@pytest.fixture(scope="module")
def bundled(bundled):
    """The session's bundled model (tests/conftest.py), when its consensus memory is there."""
    if bundled.resources.memory is None:
        pytest.skip("no consensus memory beside the bundled model (captioner-build-consensus writes it)")
    return bundled


def test_weight_zero_gives_todays_captions(bundled):
    """With decode.fitted_choice=false (the beam's own order) the product path writes exactly the captions of a
    model without a memory."""
    photos = bundled.read_batch(EXAMPLES)
    off = caption_photos(bundled, photos, fitted_choice=False)
    without = captioner.Captioner(bundled.model, bundled.vocab, bundled.config, fitted=bundled.resources.fitted)
    plain = caption_photos(without, photos)  # the same file's fitted data, no memory
    assert [c.text for c in off] == [c.text for c in plain] and [c.score for c in off] == [c.score for c in plain]
    on = caption_photos(bundled, photos)  # the file's fitted choice: the caption is one of the beam's
    for c, o in zip(on, plain):
        assert c.text in [o.text, *(a.text for a in o.alternatives)]
        assert c.weights == bundled.resources.fitted.choice.to_json()  # each caption says what chose it


@pytest.mark.slow
def test_saving_a_captioner_writes_its_memory_beside_the_file(bundled, tmp_path):
    path = tmp_path / "copy.safetensors"
    bundled.save(path)
    again = captioner.load(path)
    assert len(again.resources.memory) == len(bundled.resources.memory)
    assert again.resources.fitted == bundled.resources.fitted  # and keeps its fitted data
    photo = again.read(EXAMPLES[0])
    assert photo.caption().text == bundled.read(EXAMPLES[0]).caption().text


def test_a_memory_built_for_another_encoder_is_refused_on_load(bundled, tmp_path):
    """The memory's features come from one encoder: beside a model whose encoder differs they would find the wrong
    neighbours, so captioner.load refuses the pair and says how to fix it."""
    path = tmp_path / "m.safetensors"
    bundled.save(path)
    memory, _ = _memory(D=1280)
    memory.vocab_size, memory.encoder = len(bundled.vocab), "another-encoder"
    memory.save(memory_path(path))
    with pytest.raises(CheckpointError, match="captioner-build-consensus"):
        captioner.load(path)
