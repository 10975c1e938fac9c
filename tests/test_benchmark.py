"""The benchmark CLI: its synthetic inputs are realistic, and a --quick run reports sane numbers."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from captioner.bench.synthetic import (PRESETS, install_length_counter, make_batches, naive_batch, sample_lengths,
                                       set_length_offset)
from captioner.bench.training import decoder_train_flops
from captioner.cli.benchmark import main
from captioner.config import DecodeConfig
from captioner.decoding.search import decode
from captioner.vocab import SpecialIds
from captioner.model import int8_rows
from captioner.model.decoder import Decoder


def test_sampled_caption_lengths_follow_the_dataset():
    rng = np.random.default_rng(0)
    for preset in PRESETS.values():
        n = sample_lengths(preset, 20_000, rng)
        assert abs(n.mean() - preset.len_mean) < 0.3
        assert abs(n.std() - preset.len_std) < 0.5
        assert n.min() >= preset.len_min and n.max() <= preset.len_max


def test_bucketed_batches_are_shorter_and_naive_batches_share_nothing():
    p = PRESETS["flickr8k"]
    fast = make_batches(p, 6, 4, bucket=True, seed=0)
    plain = make_batches(p, 6, 4, bucket=False, seed=0)
    assert all(len(b.lengths) == 20 and b.visual.shape == (4, p.regions, p.feat_dim) for b in fast)
    assert all(bool((b.lengths[1:] <= b.lengths[:-1]).all()) for b in fast)  # sorted for the shrinking batch
    pad = lambda bs: np.mean([1 - float(b.lengths.sum()) / b.inputs.numel() for b in bs])  # noqa: E731
    assert pad(fast) < pad(plain)  # bucketing wastes fewer positions
    nb = naive_batch(plain[0])
    assert nb.visual.shape[0] == len(nb.lengths) and torch.equal(nb.image_index, torch.arange(len(nb.lengths)))
    assert torch.equal(nb.visual[3], plain[0].visual[plain[0].image_index[3]])
    assert decoder_train_flops(p, nb, fast=False) > 3 * decoder_train_flops(p, plain[0], fast=True)


def test_length_counter_makes_an_untrained_decoder_stop_at_the_requested_length():
    torch.manual_seed(0)
    dec = Decoder(50, 16, embed_dim=8, hidden_dim=12, attention_dim=8).eval()
    feats = torch.randn(32, 9, 16).clamp(0, 6)
    install_length_counter(dec, feats, spread_words=3.0)
    for words in (6, 11):
        set_length_offset(dec, words)
        for beam in (1, 3):
            lens = [len(h[0].tokens) for h in decode(dec, feats, SpecialIds(1, 2, 0), DecodeConfig(beam, 40, 0.0))]
            assert abs(np.mean(lens) - words) < 1.5, (words, beam, lens)
            assert np.std(lens) > 1.0  # lengths vary over images, like real captions
    # the decoder's shapes are untouched: decoding costs what it costs for a trained model
    assert dec.out_vocab.weight.shape == (50, 8) and dec.gates_hidden.weight.shape == (48, 12)


@pytest.mark.slow
def test_quick_benchmark_reports_every_section(capsys):
    threads = torch.get_num_threads()
    assert main(["--quick", "--json"]) == 0
    assert torch.get_num_threads() == threads  # --quick's single thread does not leak into other tests
    res = json.loads(capsys.readouterr().out)

    tc = res["train_cached"]
    for mode in ("fast", "naive"):
        assert tc[mode]["captions_per_s"] > 0 and tc[mode]["step_ms_median"] > 0 and tc[mode]["gflop_per_step"] > 0
    assert tc["naive"]["mean_padded_len"] >= tc["fast"]["mean_caption_tokens"]
    assert tc["speedup"] > 1, tc  # the real training path beats the naive loop even at toy batch sizes
    ld = tc["load"]  # the real loader reading the preset's float16 memory map, beside the step
    assert ld["cold_ms_median"] > 0 and ld["warm_ms_median"] > 0 and ld["timed_batches"] >= 1
    assert ld["shape"] == "9x9x1280 float16" and ld["batch_mib"] == pytest.approx(4 * 81 * 1280 * 2 / 2**20)

    te = res["train_encoder"]
    for mode in ("frozen", "fine_tuned"):
        assert te[mode]["captions_per_s"] > 0 and te[mode]["images_per_s"] > 0
    assert te["frozen"]["encode_images_per_s"] > 0

    ev = res["eval"]
    for beam in (1, 3, 5):
        assert ev[f"beam{beam}"]["images_per_s"] > 0
        assert 3 <= ev[f"beam{beam}"]["mean_words"] <= 25  # captions end like real ones, not at max_len
    assert ev["naive_beam3"]["images_per_s"] > 0 and ev["speedup_beam3"] > 0
    assert ev["one_image_beam3"]["images_per_s"] > 0 and ev["speedup_beam3_vs_one_image"] > 0
    assert ev["model"]

    la = res["latency"]
    assert 0 < la["p50_ms"] <= la["p95_ms"] and la["mean_words"] > 0 and la["model"] and la["beam"] == 3
    stored = res["latency_stored"]  # the model file's own decode settings, what users get
    assert stored["stored_settings"] and 0 < stored["p50_ms"] <= stored["p95_ms"]
    if int8_rows.available():  # the int8 precision the app offers on a CPU, timed beside it
        fast = res["latency_stored_int8"]
        assert fast["stored_settings"] and 0 < fast["p50_ms"] <= fast["p95_ms"] and fast["mean_words"] > 0
    ex = res["latency_explain"]
    assert ex["words"] == 12 and 0 < ex["p50_ms"] <= ex["p95_ms"]

    assert res["peak_memory_mb"] > 0
    assert set(res["targets"]) == {"train_cached_speedup>=3x", "eval_beam3_speedup>=10x", "latency_beam3_p50<250ms",
                                   "latency_stored_p50<150ms", "explain_12_words_p50<100ms"}
    assert all(t["met"] is None and "not judged" in t["note"] and t["value"] > 0 for t in res["targets"].values())
    assert res["machine"]["torch_threads"] == 1 and res["quick"] is True


def test_targets_are_judged_only_on_a_full_run():
    from captioner.bench.report import targets

    res = {"latency": {"p50_ms": 300.0}, "latency_explain": {"p50_ms": 50.0}}
    assert targets({**res, "quick": False}) == {"latency_beam3_p50<250ms": {"value": 300.0, "met": False},
                                                "explain_12_words_p50<100ms": {"value": 50.0, "met": True}}
    assert all(t["met"] is None for t in targets({**res, "quick": True}).values())


@pytest.mark.slow
def test_table_output(capsys):
    assert main(["--quick", "--only", "latency"]) == 0
    out = capsys.readouterr().out
    assert "MISSED" not in out and "met" not in out.split("| measurement")[0]  # a quick run judges no target ...
    assert "target latency_beam3_p50<250ms:" in out and "-> not judged (--quick)" in out  # ... and says so
    assert "run without --quick to judge the targets" in out
    assert "caption latency, 1 image, beam 3" in out and "stored settings" in out and "| measurement" in out and "peak memory" in out


@pytest.mark.slow
def test_latency_breakdown_on_real_photos(capsys, coco_mini):
    """The per-photo breakdown at the stored settings on real JPEGs: every stage timed, the ratios are
    the end-to-end times over preprocess + encoder, and the table shows it."""
    assert main(["--quick", "--only", "latency", "--photos", str(coco_mini / "train2017"), "--json"]) == 0
    bd = json.loads(capsys.readouterr().out)["latency_breakdown"]
    for k in ("read_preprocess", "encoder", "decoding", "concepts", "caption", "explain_decoder", "explain"):
        assert bd[f"{k}_ms"] > 0, k
    front = bd["read_preprocess_ms"] + bd["encoder_ms"]
    assert bd["caption_over_preprocess_encoder"] == pytest.approx(bd["caption_ms"] / front)
    assert bd["explain_over_preprocess_encoder"] == pytest.approx(bd["explain_ms"] / front)
    assert bd["photos"] == 80 and bd["beam"] == 5 and bd["words"] == 12 and bd["torch_threads"] == 1
    assert main(["--quick", "--only", "latency"]) == 0
    assert "read + preprocess / encoder / decoding / concepts" in capsys.readouterr().out
