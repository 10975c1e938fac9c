"""train.capture (training/captured_step.py): the cross-entropy step recorded per batch shape and replayed. A CPU
has no CUDA graphs; model.graphs.Rerun keeps their contract here (recorded with every host read refused,
replayed into the recorded outputs), so a recorded run must train as the op-by-op one does."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from captioner.config import Config, load_config
from captioner.data.dataset import Batch
from captioner.model.graphs import Rerun
from captioner.model.show_attend_tell import ShowAttendTell
from captioner.training import captured_step
from captioner.training.captured_step import ROWS_STEP, T_STEP, CapturedStep, why_op_by_op
from captioner.training.engine import finish_step, train_step
from captioner.training.loss import caption_loss
from captioner.training.objectives import CrossEntropy

from .conftest import batch as random_captions, tiny_decoder

CPU = torch.device("cpu")


def _batch(images: int, lengths: tuple[int, ...], V: int = 12) -> Batch:
    """A cached-feature batch: `images` photos of 9 regions, the captions' lengths sorted descending, each caption
    of photo i % images."""
    inputs, targets, lens, _ = random_captions(V, lengths)
    index = torch.arange(len(lengths)) % images
    return Batch(torch.rand(images, 9, 16), inputs, targets, lens, index)


def _model() -> ShowAttendTell:
    return ShowAttendTell(torch.nn.Identity(), tiny_decoder()).train()  # type: ignore[arg-type]


def test_static_teacher_forcing_equals_the_shrinking_batch_and_so_does_its_gradient():
    """teacher_force_static runs every caption all T steps and masks past its end: the logits, maps and gates of
    teacher_force (zero where t >= length), and eq. 14's gradient through either is the same."""
    dec, b = tiny_decoder(), _batch(3, (7, 6, 6, 4, 2, 1))
    grads = []
    for force in (dec.teacher_force, dec.teacher_force_static):
        dec.zero_grad()
        out = force(b.visual, b.inputs, b.lengths, b.image_index)
        if force == dec.teacher_force:
            ref = out
        else:
            for x, y in zip(ref[:3], out[:3]):
                torch.testing.assert_close(y, x, atol=1e-6, rtol=1e-5)
        caption_loss(out.logits, out.alphas, b.targets, b.lengths).total.backward()
        grads.append([p.grad.clone() for p in dec.parameters()])
    for x, y in zip(*grads):
        torch.testing.assert_close(y, x, atol=1e-6, rtol=1e-5)


def test_recorded_steps_train_as_the_op_by_op_steps(monkeypatch):
    """Six steps over batches of two shapes (two recordings, each made once): the same losses, gradient norms and
    weights after every step as engine.train_step's, at dropout 0. (SGD: Adam would blow up the float noise in the
    attention score's bias, whose true gradient is 0, softmax being blind to a shift, into whole steps.)"""
    eager, recorded = _model(), _model()
    recorded.load_state_dict(eager.state_dict())
    cfg = Config()
    opt_e = torch.optim.SGD(eager.decoder.parameters(), lr=0.1)
    opt_r = torch.optim.SGD(recorded.decoder.parameters(), lr=0.1)
    step = CapturedStep(recorded, cfg, CPU, Rerun, None)
    objective = CrossEntropy(cfg)
    shapes = [_batch(2, (5, 5, 3, 2)), _batch(3, (11, 9, 6, 6, 3, 1))]
    for i in range(6):
        b = shapes[i % 2]
        a = train_step(lambda x: objective(eager, x), opt_e, b, cfg, CPU)
        r = finish_step(opt_r, step(b), cfg)
        for key in ("xent", "penalty"):
            assert r.logs[key] == pytest.approx(a.logs[key], rel=1e-5), (i, key)
        assert r.weight == a.weight
        assert float(r.grad_norm) == pytest.approx(float(a.grad_norm), rel=1e-4)
        for p, q in zip(eager.parameters(), recorded.parameters()):
            torch.testing.assert_close(q, p, atol=1e-5, rtol=1e-4)
    assert [k[:3] for k in step.recorded] == [(2, ROWS_STEP, T_STEP), (3, ROWS_STEP, 2 * T_STEP)]  # one a shape
    assert [rec.graph.replays for rec in step.recorded.values()] == [3, 3]  # every step a replay


def test_batches_of_other_caption_counts_share_a_recording_through_rows_of_length_0():
    """Photos with 5, 6 or 7 captions (COCO has some) make batches of other caption counts: rows of length 0 fill
    them to a multiple of ROWS_STEP, and they count nowhere (no token, no penalty), so 5, 6 and 7 captions train
    in one recording as op by op."""
    eager, recorded = _model(), _model()
    recorded.load_state_dict(eager.state_dict())
    cfg = Config()
    opt_e = torch.optim.SGD(eager.decoder.parameters(), lr=0.1)
    opt_r = torch.optim.SGD(recorded.decoder.parameters(), lr=0.1)
    step, objective = CapturedStep(recorded, cfg, CPU, Rerun, None), CrossEntropy(cfg)
    for lengths in ((6, 5, 4, 4, 2), (6, 6, 5, 3, 3, 2), (5, 5, 4, 4, 3, 2, 1)):
        b = _batch(2, lengths)
        a = train_step(lambda x: objective(eager, x), opt_e, b, cfg, CPU)
        r = finish_step(opt_r, step(b), cfg)
        assert (r.logs["xent"], r.logs["penalty"]) == pytest.approx((a.logs["xent"], a.logs["penalty"]), rel=1e-5)
        for p, q in zip(eager.parameters(), recorded.parameters()):
            torch.testing.assert_close(q, p, atol=1e-5, rtol=1e-4)
    assert len(step.recorded) == 1


def test_a_recorded_step_with_dropout_draws_what_the_op_by_op_static_step_draws():
    """Recording draws nothing from the run's random stream (fork_rng): from the same seed, recorded steps with
    dropout give the op-by-op static step's gradients, number for number."""
    a, b = _model(), _model()
    for m in (a, b):
        m.decoder.dropout.p = 0.5
    b.load_state_dict(a.state_dict())
    data, cfg = _batch(2, (6, 4, 4, 2)), Config()
    ref, step = CapturedStep(a, cfg, CPU, Rerun, None), CapturedStep(b, cfg, CPU, Rerun, None)
    torch.manual_seed(7)
    expected = [[g.clone() for g in ref._forward_backward(*_static(data))[1:]] for _ in range(2)]  # op by op
    torch.manual_seed(7)
    for want in expected:
        step(data)
        for p, g in zip(b.parameters(), want):
            torch.testing.assert_close(p.grad, g)


def _static(b: Batch) -> tuple[torch.Tensor, ...]:
    """`b` as a recording's static inputs hold it: T_STEP steps, ROWS_STEP rows (the padding rows of length 0)."""
    B, T = b.inputs.shape
    rows, steps = -(-B // ROWS_STEP) * ROWS_STEP - B, -(-T // T_STEP) * T_STEP - T
    pad = torch.nn.functional.pad
    return (b.visual, pad(b.inputs, (0, steps, 0, rows)), pad(b.targets, (0, steps, 0, rows)), pad(b.lengths, (0, rows)),
            pad(b.image_index, (0, rows)))


def test_a_step_that_reads_the_host_is_not_recorded_and_says_so(monkeypatch):
    """A recording refuses host reads; the shape then trains op by op (None: the engine's train_step) after one
    warning, and is not tried again."""
    model = _model()
    real = model.decoder.teacher_force_static

    def reads(feats, inputs, lengths, image_index):
        int(lengths.max())  # a read a graph cannot hold
        return real(feats, inputs, lengths, image_index)

    monkeypatch.setattr(model.decoder, "teacher_force_static", reads)
    step, b = CapturedStep(model, Config(), CPU, Rerun, None), _batch(2, (4, 3))
    with pytest.warns(RuntimeWarning, match="trains op by op"):
        assert step(b) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert step(b) is None
    assert all(p.grad is None for p in model.parameters())


def test_what_is_not_recorded_is_named():
    model = _model()
    cfg = Config()
    assert why_op_by_op(cfg, model, 1, False) is None
    cfg.train.objective = "scst"
    assert "scst" in why_op_by_op(cfg, model, 1, False)
    cfg = Config()
    cfg.train.accumulate = 2
    assert "accumulate" in why_op_by_op(cfg, model, 1, False)
    assert "processes" in why_op_by_op(Config(), model, 2, False)
    assert "GradScaler" in why_op_by_op(Config(), model, 1, True)
    logs = []
    cfg = Config()
    cfg.train.capture = True
    assert captured_step.build_captured_step(cfg, model, CPU, 1, None, logs.append) is None
    assert "CUDA GPU" in logs[0]


@pytest.mark.slow
def test_a_recorded_run_logs_the_op_by_op_run(tmp_path, monkeypatch):
    """configs/tiny.yaml on 8 real photos, dropout 0: train.capture (Rerun standing in for CUDA graphs) logs the
    op-by-op run's cross-entropy, penalty and gradient norm at every step, and the same validation."""
    from captioner.logs import read_jsonl
    from captioner.training.engine import fit

    from .conftest import need_flickr

    monkeypatch.setitem(captured_step.GRAPHS, "cpu", Rerun)
    lines: dict[str, list[str]] = {}

    def run(out: str, *sets: str) -> list[dict]:
        cfg = load_config("configs/tiny.yaml", [
            f"data.root={need_flickr()}", f"data.cache_dir={tmp_path / 'cache'}", f"train.out_dir={tmp_path / out}",
            "train.val_limit=2", "train.tensorboard=false", "train.checkpoint_every=0", "model.dropout=0",
            "train.log_every=1", *sets])
        fit(cfg, log=lines.setdefault(out, []).append, progress=False)
        return read_jsonl(tmp_path / out / "metrics.jsonl")

    eager, recorded = run("eager"), run("recorded", "train.capture=true")
    assert any("recorded once" in line for line in lines["recorded"])
    assert [r["step"] for r in recorded if r["kind"] == "train"] == [r["step"] for r in eager if r["kind"] == "train"]
    for a, b in zip(eager, recorded, strict=True):
        for key in ("xent", "penalty", "grad_norm", "train_xent", "BLEU_4", "Bleu_4", "CIDEr"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), (a.get("step"), key)


def test_the_benchmark_step_replays_and_falls_back_to_op_by_op(monkeypatch):
    """bench.training._recorded_step (the benchmark's recorded mode): a recorded shape trains by a replay; a shape
    that could not be recorded trains by engine.train_step. Either way the weights move."""
    from captioner.bench.training import _recorded_step

    cfg, model = Config(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = CapturedStep(model, cfg, CPU, Rerun, None)
    before = [p.detach().clone() for p in model.parameters()]
    _recorded_step(step, opt, cfg, _batch(2, (4, 3)))
    assert next(iter(step.recorded.values())).graph.replays == 1
    monkeypatch.setattr(CapturedStep, "__call__", lambda self, b: None)
    _recorded_step(step, opt, cfg, _batch(2, (4, 3)))
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU (scripts/gpu_check.py runs it)")
def test_cuda_graph_steps_train_as_op_by_op_on_the_gpu():
    """Real CUDA graphs: four steps over two shapes, float32 and dropout 0, against engine.train_step on the same
    GPU; then with bf16 autocast, the recorded run's losses stay within bf16's rounding of the op-by-op run's."""
    from captioner.model.graphs import CudaGraph
    from captioner.training.run import amp_dtype

    gpu = torch.device("cuda")
    for amp in (False, True):
        eager, recorded = _model().to(gpu), _model().to(gpu)
        recorded.load_state_dict(eager.state_dict())
        cfg = Config()
        cfg.train.amp = amp
        opt_e = torch.optim.SGD(eager.decoder.parameters(), lr=0.1)
        opt_r = torch.optim.SGD(recorded.decoder.parameters(), lr=0.1)
        step, objective = CapturedStep(recorded, cfg, gpu, CudaGraph, amp_dtype(gpu, cfg)), CrossEntropy(cfg)
        shapes = [_batch(2, (5, 5, 3, 2)), _batch(3, (11, 9, 6, 6, 3, 1))]
        for i in range(4):
            b = shapes[i % 2]
            a = train_step(lambda x: objective(eager, x), opt_e, b, cfg, gpu)
            r = finish_step(opt_r, step(b), cfg)
            tol = dict(rel=2e-2, abs=1e-2) if amp else dict(rel=1e-4, abs=1e-6)
            assert r.logs["xent"] == pytest.approx(a.logs["xent"], **tol), (amp, i)
            if not amp:
                for p, q in zip(eager.parameters(), recorded.parameters()):
                    torch.testing.assert_close(q, p, atol=1e-4, rtol=1e-3)
        assert len(step.recorded) == 2 and all(rec is not None for rec in step.recorded.values())


def test_a_recorded_training_step_is_one_launch_and_one_read():
    """bench_train_launches (captioner-benchmark --only launches): the recorded step launches its graph once and
    reads the device once (its losses), besides Adam's host-side counters; op by op it launches every word's
    attention and cell, forward and backward."""
    from captioner.bench.launches import bench_train_launches
    from captioner.bench.synthetic import Preset

    small = Preset("small", 30, "none", 32, 3, 16, 8, 12, 10, 6.0, 2.0, 2, 12, 12)
    res = bench_train_launches(small, batch_images=2)
    eager, recorded, adam = res["op_by_op"], res["recorded"], res["optimizer_host_reads"]
    assert recorded["graph_launches"] == 1 and eager["graph_launches"] == 0
    assert recorded["syncs"] - adam == 1 and recorded["reads"] == 1  # the losses, read once (tolist)
    assert eager["syncs"] - adam >= 3  # the lengths, the token count, the finite check ...
    assert recorded["kernels"] * 5 < eager["kernels"]
