"""scripts/gpu_check.py, the one script a machine with a GPU runs: each row killed at its time limit even when it
prints nothing, exit 130 passing only the row stopped by SIGINT on purpose, and the memory row's library function
(bench/memory.py) on any machine."""
from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from captioner.bench.memory import GPU_SIZES_GIB, HEADROOM, LONG_CAPTION_TOKENS, memory_report, training_memory
from captioner.bench.synthetic import CAPTIONS_PER_IMAGE, Preset
from captioner.bench.training import decoder_model

from .conftest import ROOT, run

SMALL = Preset("small", 300, "efficientnet_lite0", 64, 4, 64, 32, 48, 40, 8.0, 2.0, 1, 20, 10)


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


gpu_check = _script()


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "State:\tZ" not in status.read_text()  # a zombie has ended; only its entry waits to be read
    except FileNotFoundError:
        return False


def test_a_silent_hang_is_killed_at_the_rows_time_limit_with_its_children():
    """A command that prints one line then hangs silently (and leaves a child of its own) is killed at its time
    limit, the child too (the row's process group), and the row says so."""
    hang = ("import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            "print('child', child.pid, flush=True)\n"
            "time.sleep(120)")
    row = gpu_check.Row("hang", _python(hang), timeout=3)
    t = time.monotonic()
    res = gpu_check.run(row)
    assert time.monotonic() - t < 30 and res.timed_out and res.code != 0
    assert gpu_check.verdict(row, res) == "killed after 3 s"
    child = int(res.output.split()[1])
    for _ in range(50):
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child), "the command's own child outlived the timeout"


SIGINT_130 = ("import signal, sys, time\n"
              "signal.signal(signal.SIGINT, lambda *_: sys.exit(130))\n"
              "print('epoch 1'); print('step 3: loss 2.0', flush=True)\n"
              "time.sleep(60)\n"
              "sys.exit(0)")


def test_only_the_row_stopped_by_sigint_on_purpose_may_exit_130():
    stopped = gpu_check.Row("stopped", _python(SIGINT_130), timeout=60, stop_after="step 3:")
    res = gpu_check.run(stopped)
    assert res.interrupted and res.code == 130 and res.seconds < 30
    assert gpu_check.verdict(stopped, res) == "ok"
    plain = gpu_check.Row("plain", _python("import sys; sys.exit(130)"))
    assert gpu_check.verdict(plain, gpu_check.run(plain)) == "exit 130, expected 0"
    never = gpu_check.Row("never", _python("print('epoch 1')"), stop_after="step 3:")
    res = gpu_check.run(never)
    assert res.code == 0 and not res.interrupted
    assert gpu_check.verdict(never, res) == "never printed 'step 3:' (no SIGINT sent)"
    ok = gpu_check.Row("ok", _python("print('done')"))
    assert gpu_check.verdict(ok, gpu_check.run(ok)) == "ok"


def test_only_runs_the_rows_named_and_a_word_no_row_has_is_an_error():
    rows = [gpu_check.Row(name, ["true"]) for name in ("latency: caption()", "a photo library of 60 photos",
                                                         "train, SIGINT at step 3", "train, resumed")]
    assert gpu_check.chosen(rows, None) == rows
    assert [r.name for r in gpu_check.chosen(rows, ["LIBRARY", "latency"])] == ["latency: caption()",
                                                                                 "a photo library of 60 photos"]
    assert [r.name for r in gpu_check.chosen(rows, ["train"])] == ["train, SIGINT at step 3", "train, resumed"]
    with pytest.raises(SystemExit, match="--only torchrun: no row's name has it; the rows: latency"):
        gpu_check.chosen(rows, ["torchrun"])


def test_settings_are_named():
    assert gpu_check.settings({"train.epochs": 3, "data.root": Path("/x")}) == ["--set", "train.epochs=3",
                                                                               "data.root=/x"]


def test_the_memory_row_on_a_cpu():
    """memory_report: the fixed part is the weights, gradients and Adam's two moments; each GPU size gets the
    largest batch of long captions whose bytes fit its memory x HEADROOM (one more image would not); a larger
    memory never gets a smaller batch; a CPU has no measured step."""
    res = memory_report(torch.device("cpu"), SMALL)
    params = sum(p.numel() for p in decoder_model(SMALL, False).parameters() if p.requires_grad)
    m = training_memory(SMALL)
    assert m.fixed_bytes == 4 * 4 * params and res["fixed_MiB"] == round(m.fixed_bytes / 2**20)
    assert m.bytes_per_token > 0 and res["KiB_per_token"] == round(m.bytes_per_token / 1024)
    per_image = CAPTIONS_PER_IMAGE * LONG_CAPTION_TOKENS * (m.bytes_per_token + m.logits_bytes_per_token)
    batches = [res[f"batch_images_{gib}GiB_p99_captions"] for gib in GPU_SIZES_GIB]
    for gib, n in zip(GPU_SIZES_GIB, batches):
        assert m.fixed_bytes + n * per_image <= gib * 2**30 * HEADROOM < m.fixed_bytes + (n + 1) * per_image
    assert batches == sorted(batches) and batches[0] > 0
    assert "measured_peak_GiB_at_it" not in res


def test_a_wider_decoder_keeps_more_bytes_per_token():
    wide = Preset(**{**SMALL.__dict__, "hidden_dim": 4 * SMALL.hidden_dim})
    assert training_memory(wide).bytes_per_token > training_memory(SMALL).bytes_per_token


@pytest.mark.slow
def test_the_quick_check_passes_on_a_cpu(tmp_path):
    """scripts/gpu_check.py --device cpu --quick: every row passes (about a minute on a quiet 2-core machine)."""
    out = run("scripts/gpu_check.py", "--device", "cpu", "--quick", "--out", str(tmp_path / "check"), timeout=900)
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 16 and all(row.split(" | ")[1] == "ok" for row in rows), out.stdout
    figures = {row.split(" | ")[0][2:]: row.split(" | ")[4] for row in rows}
    assert "launches_device_search.one_caption.syncs" in next(v for k, v in figures.items() if k.startswith("launches"))
    assert "photos/s" in next(v for k, v in figures.items() if k.startswith("a photo library"))
    assert os.path.isfile(tmp_path / "check" / "gpu_check.json")
