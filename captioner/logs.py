"""Run logs: one JSON object per line (metrics.jsonl), a PNG plot of loss and val metrics, and progress over a
long loop: a bar on a terminal, plain lines in a log file or a pipe."""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
LINE_EVERY_S = 60.0  # without a terminal, a progress line at least this often (and at each tenth of the way)


class JsonlLogger:
    def __init__(self, path: str | Path, enabled: bool = True):
        self.path, self.enabled = Path(path), enabled
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def rewind(self, step: int, validation_owed: bool) -> int:
        """Before a resumed run goes on from a checkpoint at `step` (with that step's validation still owed, or not):
        drop what the interrupted run logged after that point (the resumed run logs it again), so each step and
        each validation appears once. Returns how many records were dropped."""
        if not self.enabled or not self.path.is_file():
            return 0
        rows = read_jsonl(self.path)
        keep = [r for r in rows if not (r.get("kind") == "train" and r.get("step", 0) > step)
                and not (r.get("kind") == "val" and (r.get("step", 0) > step
                                                     or (r.get("step", 0) == step and validation_owed)))]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        tmp.replace(self.path)  # atomic: a crash here leaves the old log, never half of one
        return len(rows) - len(keep)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a crash: skip it
            continue
    return out


def loss_points(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The training-loss points to draw: the logged steps, or for a short run that logged fewer than two (fewer
    steps than train.log_every) each epoch's averages, at the epoch's last step."""
    train = [r for r in rows if r.get("kind") == "train"]
    if len(train) >= 2:
        return train
    return [{"step": r["step"], **{k[len("train_"):]: v for k, v in r.items() if k.startswith("train_")}}
            for r in rows if r.get("kind") == "val" and ("train_xent" in r or "train_reward" in r)]


def plot_history(jsonl: str | Path, png: str | Path) -> None:
    """Training loss terms per step (left) and validation metrics per epoch (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_jsonl(jsonl)
    train, val = loss_points(rows), [r for r in rows if r.get("kind") == "val"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    if train:
        steps = [r["step"] for r in train]
        # cross-entropy runs log xent; self-critical runs log the sampled captions' reward and baseline
        # (the mean-of-others baseline averages to the mean reward by construction: drawn only if it differs)
        same = all(abs(r.get("baseline", 0.0) - r.get("reward", 0.0)) < 1e-6 for r in train)
        colors = {"xent": "tab:blue", "reward": "tab:green", "baseline": "tab:purple"}
        main_keys = [k for k in colors if k in train[-1] and not (k == "baseline" and same)]
        for k in main_keys:
            ax1.plot(steps, [r.get(k, float("nan")) for r in train], label=k, color=colors[k], marker=".")
        ax1.set_ylabel(" | ".join({"xent": "cross-entropy / token", "reward": "CIDEr-D of samples"}.get(k, k)
                                  for k in main_keys if k != "baseline"))
        ax1.legend(loc="upper left")
        pen = "penalty" if "penalty" in train[-1] else "attention"  # older logs called it "attention"
        twin = ax1.twinx()  # the penalty lives on another scale (it sums over all P regions)
        twin.plot(steps, [r.get(pen, float("nan")) for r in train], color="tab:orange", alpha=0.6, linestyle="--")
        twin.set_ylabel("lambda * attention penalty / caption", color="tab:orange")
        ax1.set_xlabel("step")
        ax1.set_title("training objective")
    if val:
        epochs = [r["epoch"] for r in val]
        for key in ("Bleu_4", "CIDEr", "METEOR", "ROUGE_L"):
            if key in val[0]:
                ax2.plot(epochs, [r[key] for r in val], marker="o", label=key)
        ax2.set_xlabel("epoch")
        ax2.set_title("validation (decoded captions)")
        ax2.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def progress(items: Iterable[T], desc: str, total: int | None = None, enabled: bool = True,
             unit: str = "batch") -> Iterable[T]:
    """`items`, with their progress on stderr: a tqdm bar where stderr is a terminal; elsewhere (a log file, a
    pipe, a job's captured output, where a bar's carriage returns show nothing until the end) a line at each tenth
    of the way and at least every LINE_EVERY_S seconds (progress_line)."""
    if not enabled:
        return items
    total = total if total is not None else (len(items) if hasattr(items, "__len__") else None)  # type: ignore[arg-type]
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(items, desc=desc, total=total, unit=unit, file=sys.stderr)
    return _progress_lines(items, desc, total, unit)


def _progress_lines(items: Iterable[T], desc: str, total: int | None, unit: str) -> Iterator[T]:
    t0 = last = time.monotonic()
    tenth = 0
    for k, item in enumerate(items, 1):
        yield item  # the caller's work on it is done when it asks for the next one
        now = time.monotonic()
        step = k * 10 // total if total else 0
        if step > tenth or now - last >= LINE_EVERY_S or k == total:
            print(progress_line(desc, k, total, unit, now - t0), file=sys.stderr, flush=True)
            tenth, last = step, now


def progress_line(desc: str, done: int, total: int | None, unit: str, seconds: float) -> str:
    """'decoding: 3/10 batch (30%)', the seconds since the start and the time left at that pace (without a total:
    the count and the seconds)."""
    if not total:
        return f"{desc}: {done} {unit}, {seconds:.0f} s"
    left = seconds / done * (total - done)
    return f"{desc}: {done}/{total} {unit} ({100 * done // total}%), {seconds:.0f} s, about {left:.0f} s left"
