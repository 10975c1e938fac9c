"""decoding/device_beam.py: the GPU's search recorded once per shape and replayed. A CPU has no CUDA graphs, so these
run the graph's contract (model/graphs.py's Rerun: recorded with every host read refused, replayed into the same outputs):
a replay finds the hypotheses the eager search finds for whatever photos were copied in, every step runs without
a read, shapes and trained weights get their own recordings, and a recording that fails falls back to the eager
search."""
from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch

import captioner
from captioner.config import DecodeConfig
from captioner.decoding.device_beam import chunk_sizes, search
from captioner.model import graphs as captured
from captioner.model.graphs import Recordings
from captioner.decoding.device_beam import beam_search_on_device, search_on_device
from captioner.model.graphs import CaptureError, NoHostReads, Rerun
from captioner.decoding.rules import photo_evidence
from captioner.decoding.reading import read_heads
from captioner.decoding.rules import Lexicon, Rules
from captioner.decoding.resources import Resources
from captioner.model.decoder import Decoder
from captioner.vocab import SpecialIds

from .test_device_beam import END, PAD, START, same

IDS = SpecialIds(START, END, PAD, 3)
LEX = Lexicon(function_words=(4, 5), bad_last=(4, 5), joiners=(4,))


def small(seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    dec = Decoder(40, 16, 12, 20, 10, 0.0).eval()
    with torch.no_grad():
        dec.out_vocab.bias[END] += 1.0  # some images end early, some run to max_len
    return dec


RULES = DecodeConfig(beam_size=3, max_len=9, length_penalty=0.7, block_trigrams=True, block_bigrams=True,
                     block_repeats=True, block_content_repeats=True)


@pytest.mark.parametrize("settings", [RULES, DecodeConfig(beam_size=1, max_len=7),
                                      dataclasses.replace(RULES, max_len=30, beam_size=2)])
def test_a_replay_finds_what_the_eager_search_finds_for_the_photos_copied_in(settings):
    dec, searches = small(), Recordings(Rerun)
    for seed in range(3):  # recorded with the first photos, replayed with others
        feats = torch.rand(2, 9, 16, generator=torch.Generator().manual_seed(seed))
        same(beam_search_on_device(dec, feats, IDS, settings), search(searches, dec, feats, IDS, settings))
    rec = next(iter(searches.recorded.values())).recording
    assert len(searches.recorded) == 1 and len(rec.chunks) == len(chunk_sizes(settings.max_len))
    assert rec.chunks[0][0].replays == 1 + 3  # once as it was recorded, then once a call


def test_the_chunks_end_where_max_len_does_and_a_search_stops_after_the_chunk_where_all_photos_are_done():
    assert chunk_sizes(30) == [12, 4, 4, 4, 6] and chunk_sizes(16) == [12, 4] and chunk_sizes(9) == [9]
    dec = small()
    with torch.no_grad():
        dec.out_vocab.bias[END] += 3.0  # every caption ends within the first chunk
    searches, settings = Recordings(Rerun), dataclasses.replace(RULES, max_len=30)
    feats = torch.rand(3, 9, 16)
    for _ in range(2):
        same(beam_search_on_device(dec, feats, IDS, settings), search(searches, dec, feats, IDS, settings))
    rec = next(iter(searches.recorded.values())).recording
    assert [graph.replays for graph, _ in rec.chunks] == [3, 1, 1, 1, 1]  # later chunks: only as recorded
    assert [graph.replays for graph, _ in rec.walks] == [2, 0, 0, 0, 0]


def test_the_search_runs_every_step_without_a_read_and_finds_the_same():
    """check_every=None: all max_len steps queued (what a graph records) and the same hypotheses as stopping
    early: an image that is done adds none. The refusal is real: the early-stopping search is refused."""
    from captioner.decoding.device_beam import read_back

    dec, feats = small(1), torch.rand(3, 9, 16)
    want = beam_search_on_device(dec, feats, IDS, RULES, Rules(IDS, RULES, lexicon=LEX), check_every=1)  # (the rules'
    with NoHostReads():  # tables are made at a search's first step, as a recording's warm-up run makes them)
        walked = search_on_device(dec, feats, IDS, RULES, Rules(IDS, RULES, lexicon=LEX), check_every=None).walked()
    assert walked[0].shape[1] == RULES.max_len
    same(want, read_back(walked))
    with pytest.raises(CaptureError, match="reads a device value"), NoHostReads():
        search_on_device(dec, feats, IDS, RULES, Rules(IDS, RULES, lexicon=LEX), check_every=1)
    with pytest.raises(CaptureError, match="copies host data"), NoHostReads():  # (what a graph would replay stale)
        torch.tensor([START, END]).to(feats)


def test_each_batch_size_and_setting_has_its_recording_and_the_oldest_goes():
    dec, searches = small(), Recordings(Rerun, limit=2)
    for B, beam in ((1, 3), (2, 3), (1, 3), (1, 2)):
        settings = DecodeConfig(beam_size=beam, max_len=6)
        feats = torch.rand(B, 9, 16)
        same(beam_search_on_device(dec, feats, IDS, settings), search(searches, dec, feats, IDS, settings))
    assert [k[1][0][0][0] for k in searches.recorded] == [1, 1]  # (2 images) went: the least recently used
    assert "beam_size=2" in list(searches.recorded)[-1][3]


def test_batch_sizes_share_the_recording_of_their_bucket():
    """A caller's every batch size would each cost a recording: a batch is padded to the next power of two up to 16,
    then to the next multiple of 16 (the last photo repeated, its results dropped), so 3 and 4 photos share one,
    and the padded rows change nothing."""
    assert [captured.bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 64, 65, 100)] == \
        [1, 2, 4, 4, 8, 8, 16, 16, 32, 64, 80, 112]
    dec, searches = small(), Recordings(Rerun)
    for B in (3, 4, 3, 5):
        feats = torch.rand(B, 9, 16)
        got = search(searches, dec, feats, IDS, RULES, Rules(IDS, RULES, lexicon=LEX))
        assert len(got) == B
        same(beam_search_on_device(dec, feats, IDS, RULES, Rules(IDS, RULES, lexicon=LEX)), got)
    assert [k[1][0][0][0] for k in searches.recorded] == [4, 8]


def test_weights_written_since_the_recording_are_recorded_again():
    """A recording reads the parameters by address and the word-gate table made from them: a training step (an
    in-place update) makes it stale, so the searches record again and find the new weights' hypotheses."""
    dec, searches, feats = small(), Recordings(Rerun), torch.rand(2, 9, 16)
    search(searches, dec, feats, IDS, RULES, Rules(IDS, RULES, lexicon=LEX))
    first = next(iter(searches.recorded.values()))
    with torch.no_grad():
        dec.out_vocab.weight.add_(0.5 * torch.randn_like(dec.out_vocab.weight))
    same(beam_search_on_device(dec, feats, IDS, RULES, Rules(IDS, RULES, lexicon=LEX)), search(searches, dec, feats, IDS, RULES, Rules(IDS, RULES, lexicon=LEX)))
    assert next(iter(searches.recorded.values())) is not first


def test_a_recording_that_fails_warns_and_that_shape_decodes_eagerly():
    class Broken(Rerun):
        def record(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing")

    dec, searches, feats = small(), Recordings(Broken), torch.rand(2, 9, 16)
    with pytest.warns(RuntimeWarning, match="beam search could not be recorded.*op by op"):
        got = search(searches, dec, feats, IDS, RULES, Rules(IDS, RULES, lexicon=LEX))
    same(beam_search_on_device(dec, feats, IDS, RULES, Rules(IDS, RULES, lexicon=LEX)), got)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per shape: the next call neither records nor warns
        same(got, search(searches, dec, feats, IDS, RULES, Rules(IDS, RULES, lexicon=LEX)))


def test_the_bundled_model_with_its_evidence_replays_other_photos(bundled):
    """The product's search (evidence with its bonus, the person floor, every rule) recorded with one photo's
    features and evidence and replayed with another's: both static inputs are copied in."""
    loaded = bundled
    photos = sorted((captioner.DEFAULT_CHECKPOINT.parent / "examples").glob("*.jpg"))[:3]
    feats = loaded.encode(torch.stack([loaded.preprocess(p) for p in photos]))  # (B, P, D)
    settings = loaded.decode_settings()
    ids = SpecialIds.of(loaded.vocab, settings.forbid_unk)
    dec, searches = loaded.model.decoder, Recordings(Rerun)
    for i in range(len(photos)):
        x = feats[i:i + 1]
        evidence = photo_evidence(read_heads(loaded.model, x), loaded.model, loaded.vocab, settings)
        rules = lambda: Rules(ids, settings, evidence, Lexicon.of(loaded.vocab))  # noqa: E731
        with torch.inference_mode(i == 1):  # either mode, in any order
            same(beam_search_on_device(dec, x, ids, settings, rules()), search(searches, dec, x, ids, settings, rules()))
    assert len(searches.recorded) == 1


def rerun_captioner(loaded: captioner.Captioner, **file_data) -> captioner.Captioner:
    """Another Captioner on `loaded`'s model whose encoder (and search) are recorded as on a GPU, with Rerun's
    contract (a CPU has no graphs); `file_data`: its fitted data and memory (none unless given)."""
    out = captioner.Captioner(loaded.model, loaded.vocab, loaded.config, capture=False, **file_data)
    out.resources = dataclasses.replace(out.resources, recordings=captured.recorded(Rerun))
    return out


def test_the_encoder_replayed_on_other_images_gives_their_features(bundled):
    """Captioner.encode through a recording (as on a GPU): each batch's features are the eager encoder's, copied out
    so the next replay cannot change them; a batch of another size gets its own recording (3 photos: 4's)."""
    loaded = rerun_captioner(bundled)
    photos = sorted((captioner.DEFAULT_CHECKPOINT.parent / "examples").glob("*.jpg"))[:3]
    x = torch.stack([loaded.preprocess(p) for p in photos])  # (3, 3, S, S)
    want = bundled.encode(x)  # (3, P, D)
    got = [loaded.encode(x[i:i + 1]) for i in range(3)] + [loaded.encode(x[1:]), loaded.encode(x)]
    for i in range(3):
        assert torch.allclose(got[i], want[i:i + 1], atol=1e-5)
    assert torch.allclose(got[3], want[1:], atol=1e-5)
    assert got[4].shape == want.shape and torch.allclose(got[4], want, atol=1e-5)  # 3 photos, padded to 4
    recorded = loaded.resources.recordings.encoder
    assert len(recorded.recorded) == 3 and all(r.recording.graph.replays >= 1 for r in recorded.recorded.values())


def test_a_captioner_records_only_on_a_gpu(bundled):
    """On a CPU the CPU beam runs (finished photos leave the batch) and nothing is recorded; `recorded` makes an
    encoder's and a search's recordings, each limited to its own number of shapes."""
    assert bundled.resources.recordings == captured.EAGER
    assert bundled.resources.recordings.encoder is None and bundled.resources.recordings.search is None
    fresh = captured.recorded(Rerun)
    assert (fresh.encoder.limit, fresh.search.limit) == (captured.ENCODER_LIMIT, captured.LIMIT)
    assert not fresh.encoder.recorded and not fresh.search.recorded


def test_a_second_captioner_on_the_same_model_leaves_the_first_as_it_was(bundled):
    """What a Captioner decodes with (its recordings, the file's fitted data and memory) is its own, never the
    model's: a second Captioner on the same model, op by op and without them, neither drops the first's recordings
    (its encoder still replays) nor changes its captions; and the second decodes without what it was not given."""
    photos = sorted((captioner.DEFAULT_CHECKPOINT.parent / "examples").glob("*.jpg"))[:2]
    first = rerun_captioner(bundled, fitted=bundled.resources.fitted, memory=bundled.resources.memory)
    before = first.caption_batch(photos)
    encoder = first.resources.recordings.encoder
    replays = sum(r.recording.graph.replays for r in encoder.recorded.values())
    second = captioner.Captioner(first.model, first.vocab, first.config, capture=False)
    assert second.resources == Resources() and first.resources.recordings.encoder is encoder
    after = first.caption_batch(photos)
    assert sum(r.recording.graph.replays for r in encoder.recorded.values()) == replays + 1  # replayed, not eager
    assert [c.to_dict() for c in after] == [c.to_dict() for c in before]
    assert [c.weights for c in after] == [c.weights for c in bundled.caption_batch(photos)]  # the file's choice
    if bundled.resources.fitted.choice is not None and bundled.resources.memory is not None:
        assert all(c.weights == {} for c in second.caption_batch(photos))  # the beam's order: nothing fitted given


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs); the tests above check "
                    "their contract on the CPU")
def test_on_a_gpu_the_recorded_search_captions_as_the_eager_one():
    """scripts/gpu_check.py runs this file on the GPU: real CUDA graphs (the encoder and the search), one photo and
    a batch, the same captions and scores as op by op, and no shape left op by op."""
    photos = sorted((captioner.DEFAULT_CHECKPOINT.parent / "examples").glob("*.jpg"))
    eager, recorded = captioner.load(device="cuda", capture=False), captioner.load(device="cuda")
    searches, encoder = recorded.resources.recordings.search, recorded.resources.recordings.encoder
    assert eager.resources.recordings == captured.EAGER and searches is not None and encoder is not None
    for got, want in [(recorded.caption(p), eager.caption(p)) for p in photos * 2] + \
            list(zip(recorded.caption_batch(photos), eager.caption_batch(photos))):
        assert got.text == want.text and got.log_prob == pytest.approx(want.log_prob, abs=1e-3)
        assert np.allclose(got.alphas, want.alphas, atol=1e-4)
    for rec in (searches, encoder):
        assert len(rec.recorded) == 2 and all(r is not None for r in rec.recorded.values())
