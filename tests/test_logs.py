"""Run logs: a resumed run rewinds metrics.jsonl to its checkpoint, so each step is logged once."""
from __future__ import annotations

import json

from captioner.logs import JsonlLogger, read_jsonl


def test_rewind_drops_what_the_interrupted_run_logged_after_its_checkpoint(tmp_path):
    log = JsonlLogger(tmp_path / "metrics.jsonl")
    for step in range(1, 7):
        log.write({"kind": "train", "epoch": 1 if step <= 4 else 2, "step": step})
        if step == 4:
            log.write({"kind": "val", "epoch": 1, "step": 4})
    log.write({"kind": "val", "epoch": 2, "step": 6})
    with open(log.path, "a") as f:
        f.write('{"kind": "train", "st')  # a line cut by kill -9
    # checkpoint: step 5, one epoch complete -> steps 6 and the epoch-2 validation will be logged again
    assert log.rewind(step=5, validation_owed=False) == 2
    rows = read_jsonl(log.path)
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4, 5]
    assert [r["epoch"] for r in rows if r["kind"] == "val"] == [1]
    assert all(json.loads(line) for line in log.path.read_text().splitlines())  # the cut line is gone too
    assert log.rewind(step=5, validation_owed=False) == 0  # idempotent
    assert JsonlLogger(tmp_path / "absent.jsonl").rewind(3, False) == 0
    # a checkpoint saved before the validation of its own step (an epoch's end, or train.val_every_steps): that
    # validation's record, written before a stop cut it short, goes too; after it, it stays
    log.write({"kind": "val", "epoch": 1.25, "step": 5})
    assert log.rewind(step=5, validation_owed=False) == 0
    assert log.rewind(step=5, validation_owed=True) == 1
    assert [r["step"] for r in read_jsonl(log.path) if r["kind"] == "val"] == [4]


def test_a_short_run_draws_its_epoch_losses(tmp_path):
    """Fewer steps than train.log_every: no train record, yet training.png's loss panel has each epoch's loss."""
    from captioner.logs import loss_points, plot_history

    log = JsonlLogger(tmp_path / "metrics.jsonl")
    for epoch in (1, 2, 3):
        log.write({"kind": "val", "epoch": epoch, "step": 7 * epoch, "train_xent": 5.0 - epoch, "train_penalty": 0.5,
                   "CIDEr": 0.1 * epoch})
    points = loss_points(read_jsonl(log.path))
    assert [(p["step"], p["xent"]) for p in points] == [(7, 4.0), (14, 3.0), (21, 2.0)]
    steps = [{"kind": "train", "step": s, "xent": 1.0} for s in (50, 100)]
    assert loss_points(steps) == steps  # logged steps win when there are enough
    plot_history(log.path, tmp_path / "training.png")
    assert (tmp_path / "training.png").stat().st_size > 0


def test_progress_without_a_terminal_prints_a_line_at_each_tenth(capsys):
    """Where stderr is not a terminal (here: pytest's capture) progress is plain lines, never a bar's carriage
    returns: one at each tenth of the way, the last one at the end, every item still yielded in order."""
    from captioner.logs import progress

    assert list(progress(range(25), "decoding")) == list(range(25))
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "\r" not in err and 10 <= len(lines) <= 11, err
    assert lines[-1].startswith("decoding: 25/25 batch (100%)") and all(line.startswith("decoding: ") for line in lines)
    assert list(progress(iter(range(3)), "reading", enabled=False)) == [0, 1, 2] and capsys.readouterr().err == ""
    list(progress(iter(range(3)), "reading", unit="photo"))  # no length: the count alone
    assert capsys.readouterr().err.splitlines() == []  # no tenth to reach, and the minute has not passed
