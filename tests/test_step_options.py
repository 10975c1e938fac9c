"""The optimizer step's options on tiny tensors: the per-step learning-rate schedule (a function of the step, so
a resume cannot change it), gradient accumulation (k micro-batches of B make the step one batch of kB makes),
and the mixed-precision choice (bf16, else fp16 with a GradScaler)."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from captioner.config import Config, load_config
from captioner.data.dataset import collate
from captioner.model.show_attend_tell import build_model
from captioner.training.engine import train_step
from captioner.training.objectives import CrossEntropy
from captioner.training.run import amp_dtype, describe_precision, grad_scaler
from captioner.training.optimizer import lr_scale, total_steps


def _train(**kw) -> Config:
    cfg = Config()
    for k, v in kw.items():
        setattr(cfg.train, k, v)
    return cfg


def test_cosine_and_linear_follow_their_formulas_after_a_linear_warmup():
    t = _train(schedule="cosine", lr=1e-3, min_lr=1e-4, warmup_steps=10).train
    total, floor = 110, 0.1
    assert [lr_scale(t, s, total) for s in range(10)] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert lr_scale(t, 10, total) == pytest.approx(1.0)  # the first step after warmup: the full rate
    for s in (10, 35, 60, 85, 109):
        p = (s - 10) / (total - 10)
        assert lr_scale(t, s, total) == pytest.approx(floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))
    assert lr_scale(t, 110, total) * t.lr == pytest.approx(t.min_lr)  # min_lr one step after the last ...
    t.min_lr = 0.0
    for schedule in ("cosine", "linear"):  # ... so with min_lr=0 the last step still learns, below every other step
        t.schedule = schedule
        rates = [lr_scale(t, s, total) for s in range(total)]
        assert 0 < rates[-1] < min(rates[:-1]) and rates[-1] < 0.02
    t.min_lr = 1e-4
    assert lr_scale(t, 60, total) == pytest.approx(1 - (1 - floor) * 50 / 100)
    assert lr_scale(t, 500, total) == pytest.approx(floor)  # past the end (more epochs later): stays at the floor


def test_plateau_without_warmup_leaves_the_rate_alone():
    t = Config().train
    assert t.schedule == "plateau" and t.warmup_steps == 0 and t.accumulate == 1  # the defaults: today's runs
    assert all(lr_scale(t, s, 100) == 1.0 for s in range(0, 200, 7))
    t.warmup_steps = 4
    assert [lr_scale(t, s, 100) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_total_steps_counts_optimizer_steps():
    assert total_steps(_train(epochs=3).train, 40) == 120
    assert total_steps(_train(epochs=3, max_steps=50).train, 40) == 50


def test_a_resumed_run_uses_the_same_rates():
    """The rate is the optimiser group's level times lr_scale(state.step): no scheduler state to lose. A step
    stopped after and resumed from its checkpoint reads the same level and the same step."""
    t = _train(schedule="cosine", warmup_steps=3, min_lr=0.0).train
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.Adam(model.parameters(), lr=t.lr)
    rates = [opt.param_groups[0]["lr"] * lr_scale(t, s, 20) for s in range(20)]
    resumed = torch.optim.Adam(torch.nn.Linear(2, 1).parameters(), lr=0.5)
    resumed.load_state_dict(opt.state_dict())  # the level travels in the checkpoint's optimizer groups
    assert [resumed.param_groups[0]["lr"] * lr_scale(t, s, 20) for s in range(7, 20)] == rates[7:]


def test_train_step_applies_the_scale_and_keeps_the_level():
    model = torch.nn.Linear(3, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = model.weight.detach().clone()
    terms_like = lambda _batch: type("T", (), {"total": model(torch.ones(1, 3)).sum(), "weight": 1, "logs": {}})()
    train_step(terms_like, opt, None, _train(grad_clip=0.0), torch.device("cpu"), lr_scale=0.1)
    assert torch.allclose(model.weight, before - 0.05)  # d(sum w)/dw = 1: SGD moved by lr x scale
    assert opt.param_groups[0]["lr"] == 0.5  # the level is kept for the next step's scale


def test_step_settings_are_checked_when_read(tmp_path):
    with pytest.raises(ValueError, match="train.schedule must be one of plateau, cosine, linear"):
        load_config(None, ["train.schedule=cosin"])
    with pytest.raises(ValueError, match="train.accumulate must be >= 1"):
        load_config(None, ["train.accumulate=0"])
    with pytest.raises(ValueError, match="train.min_lr must lie in"):
        load_config(None, ["train.min_lr=1"])
    with pytest.raises(ValueError, match=r"train.val_every_steps must be >= 0 \(0 = validate after each epoch\), got -5"):
        load_config(None, ["train.val_every_steps=-5"])
    with pytest.raises(ValueError, match="train.val_every_steps expects int, got '2k'"):
        load_config(None, ["train.val_every_steps=2k"])
    cfg = load_config(None, ["train.schedule=linear", "train.warmup_steps=100", "train.accumulate=4"])
    assert (cfg.train.schedule, cfg.train.warmup_steps, cfg.train.accumulate) == ("linear", 100, 4)


def _tiny_batch(images: int, vocab: int = 20) -> list[tuple[torch.Tensor, list[list[int]]]]:
    g = torch.Generator().manual_seed(1)
    samples = []
    for _ in range(images):
        caps = [[1] + torch.randint(4, vocab, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
                + [2] for _ in range(3)]  # <start> words <end>
        samples.append((torch.randn(49, 1280, generator=g), caps))
    return samples


@pytest.mark.parametrize("clip", [0.0, 0.05])  # 0.05: clipping acts, on the summed gradient
def test_two_accumulated_half_batches_make_the_full_batch_step(clip):
    cfg = Config()
    cfg.model.embed_dim, cfg.model.hidden_dim, cfg.model.attention_dim, cfg.model.dropout = 16, 32, 16, 0.0
    cfg.model.pretrained, cfg.train.grad_clip = False, clip
    model = build_model(cfg.model, 20)
    twin = copy.deepcopy(model)
    samples = _tiny_batch(6)
    objective = CrossEntropy(cfg)

    def step(m, batch):  # SGD: Adam's first step, g / (|g| + eps), would amplify the float noise of gradients that
        opt = torch.optim.SGD(m.decoder.parameters(), lr=0.5)  # are 0 in exact arithmetic (the score's bias)
        return train_step(lambda b: objective(m, b), opt, batch, cfg, torch.device("cpu"))

    full = step(model, collate(samples))
    halves = step(twin, [collate(samples[:2]), collate(samples[2:])])  # unequal halves: 2 and 4 images
    for a, b in zip(model.decoder.parameters(), twin.decoder.parameters()):
        # atol: float32 summation noise of gradients that are 0 in exact arithmetic (the score's bias: -4e-9 vs 1e-8)
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7)
        assert torch.allclose(a, b, rtol=0, atol=1e-6)
    assert float(halves.grad_norm) == pytest.approx(float(full.grad_norm), rel=1e-5) and float(full.grad_norm) > clip
    assert halves.weight == full.weight and halves.logs["xent"] == pytest.approx(full.logs["xent"], rel=1e-5)
    # the penalty is per caption: 6 and 12 captions, whose token counts are in another ratio, log the 18's mean
    assert halves.logs["penalty"] == pytest.approx(full.logs["penalty"], rel=1e-5)
    assert halves.counts["penalty"] == len(collate(samples).lengths) == 18


def test_the_sampler_forms_each_step_at_the_accumulated_batch_and_splits_it_in_turn():
    """k micro-batches of B per step read exactly the photos of the kB batch (sorted, shuffled and sharded at kB),
    in order; a step with fewer photos than kB (the epoch's last) splits into fewer micro-batches."""
    from captioner.data.dataset import BucketBatchSampler
    from captioner.data.loader import MicroBatches, RankBatches

    lengths = [float(3 + (i * 7) % 11) for i in range(41)]
    big = BucketBatchSampler(lengths, 8, seed=5)
    split = MicroBatches(lambda samples: list(samples), 2)  # "collate": the samples themselves
    for rank in (0, 1):
        steps = list(RankBatches(big, rank, 2))
        assert steps and all(sum(split(s), []) == s for s in steps)
        assert all(len(m) == 2 for s in steps for m in split(s)[:-1])
    last = split(list(range(5)))
    assert [len(m) for m in last] == [2, 2, 1]
    assert MicroBatches(lambda samples: None, 2)(list(range(4))) == []  # all unreadable: no micro-batch


@pytest.mark.slow
def test_an_accumulated_run_logs_the_large_batch_run_step_by_step(tmp_path):
    """configs/tiny.yaml on 8 real photos for two epochs: batch_images=2 accumulate=2 and batch_images=4 train on the
    same photos in the same steps, so every step logs the same cross-entropy, attention penalty, gradient norm and
    rate to float rounding, and the epochs' averages agree too."""
    from captioner.logs import read_jsonl
    from captioner.training.engine import fit

    from .conftest import need_flickr

    def run(out: str, *sets: str) -> list[dict]:
        cfg = load_config("configs/tiny.yaml", [
            f"data.root={need_flickr()}", f"data.cache_dir={tmp_path / 'cache'}", f"train.out_dir={tmp_path / out}",
            "train.val_limit=2", "train.tensorboard=false", "train.checkpoint_every=0", *sets])
        fit(cfg, log=lambda _: None, progress=False)
        return read_jsonl(tmp_path / out / "metrics.jsonl")

    small = run("accumulated", "train.batch_images=2", "train.accumulate=2")
    large = run("large", "train.batch_images=4")
    steps = [r for r in large if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for a, b in zip(small, large, strict=True):
        assert (a["kind"], a["step"]) == (b["kind"], b["step"])
        for key in ("xent", "penalty", "grad_norm", "lr", "train_xent", "train_penalty"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)


def test_bf16_where_the_gpu_has_it_else_fp16_with_a_scaler():
    cuda, cfg = torch.device("cuda"), Config()
    assert amp_dtype(cuda, cfg, bf16=True) is torch.bfloat16 and grad_scaler(cuda, cfg, bf16=True) is None
    assert amp_dtype(cuda, cfg, bf16=False) is torch.float16  # T4, V100: fp16, no longer float32 in silence
    cfg.train.amp = False
    assert amp_dtype(cuda, cfg, bf16=False) is None
    cpu = torch.device("cpu")
    assert amp_dtype(cpu, Config()) is None and grad_scaler(cpu, Config()) is None  # CPU: as before
    assert describe_precision(cpu, Config()) == "float32"


def test_a_grad_scaler_step_matches_the_plain_step_and_its_state_is_json():
    """The scaler path of train_step (CPU GradScaler, float32 math): unscaled before clipping, so the step and
    the logged norm are the plain step's; its state is plain numbers (saved in the train state's JSON)."""
    import json

    cfg = _train(grad_clip=0.1)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    twin = copy.deepcopy(model)
    x = torch.randn(8, 4)

    def objective(m):
        return lambda _b: type("T", (), {"total": (m(x) ** 2).mean(), "weight": 8, "logs": {}})()

    plain = train_step(objective(model), torch.optim.Adam(model.parameters(), lr=0.1), None, cfg, torch.device("cpu"))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaled = train_step(objective(twin), torch.optim.Adam(twin.parameters(), lr=0.1), None, cfg, torch.device("cpu"),
                        scaler=scaler)
    assert float(scaled.grad_norm) == pytest.approx(float(plain.grad_norm), rel=1e-6)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(a, b, atol=1e-7)
    state = json.loads(json.dumps(scaler.state_dict()))
    again = torch.amp.GradScaler("cpu")
    again.load_state_dict(state)
    assert again.get_scale() == scaler.get_scale() == 1024.0


@pytest.mark.slow
def test_a_stopped_accumulating_cosine_run_resumes_to_the_same_numbers(tmp_path, monkeypatch):
    """Warmup + cosine with 2 micro-batches per step and AdamW (dropout on, 8 real photos): stopped after its second
    step and resumed, the run logs the losses, norms and rates of an uninterrupted one; the rates follow the formula."""
    import signal

    import captioner.training.engine as engine
    from captioner.logs import read_jsonl
    from captioner.training.stopping import Interrupted, StopSignal

    from .conftest import need_flickr

    def cfg(out: str) -> Config:
        return load_config("configs/tiny.yaml", [
            f"data.root={need_flickr()}", f"data.cache_dir={tmp_path / 'cache'}", f"train.out_dir={tmp_path / out}",
            "model.dropout=0.5", "train.batch_images=1", "train.accumulate=2", "train.epochs=1", "train.val_limit=2",
            "train.schedule=cosine", "train.warmup_steps=2", "train.min_lr=3e-4", "train.tensorboard=false",
            "train.checkpoint_every=0", "train.optimizer=adamw", "train.weight_decay=0.01"])

    def rows(out: str) -> list[tuple]:
        return [(r["step"], r["xent"], r["grad_norm"], r["lr"]) for r in read_jsonl(tmp_path / out / "metrics.jsonl")
                if r["kind"] == "train"]

    quiet = dict(log=lambda _: None, progress=False)
    engine.fit(cfg("reference"), **quiet)
    stop, real = StopSignal(), engine._one_step

    def one_step(run, *args):
        real(run, *args)
        if run.state.step == 2:
            stop.request(signal.SIGINT)

    monkeypatch.setattr(engine, "_one_step", one_step)
    with pytest.raises(Interrupted):
        engine.fit(cfg("stopped"), stop=stop, **quiet)
    monkeypatch.setattr(engine, "_one_step", real)
    engine.fit(cfg("stopped"), **quiet)
    reference = rows("reference")
    assert [r[0] for r in reference] == [1, 2, 3, 4] and rows("stopped") == reference
    t = cfg("x").train
    assert [r[3] for r in reference] == pytest.approx([t.lr * lr_scale(t, s, 4) for s in range(4)])
    # warmup 2, then cosine from 1 towards the floor, reached one step after the last
    assert [r[3] for r in reference] == pytest.approx([t.lr / 2, t.lr, t.lr, t.min_lr + (t.lr - t.min_lr) / 2])


def _tiny_model(optimizer: str, weight_decay: float = 0.1):
    cfg = Config()
    cfg.model.embed_dim, cfg.model.hidden_dim, cfg.model.attention_dim, cfg.model.pretrained = 16, 32, 16, False
    cfg.model.dropout, cfg.train.optimizer, cfg.train.weight_decay = 0.0, optimizer, weight_decay
    return cfg, build_model(cfg.model, 20)


def test_adamw_decays_the_matrices_only_and_resumes_exactly():
    """adamw: biases, 1-D weights and the embedding table are not decayed, every other matrix is; the optimiser
    saved as tensors + JSON (as last.safetensors holds it) and restored steps exactly as the one that never stopped,
    and a resumed command's new weight_decay reaches only the decayed groups."""
    import json

    from captioner.checkpoint import optimizer_from_tensors, optimizer_to_tensors
    from captioner.training.optimizer import build_optimizer, keep_roles
    from captioner.training.resume import apply_to_optimizer

    cfg, model = _tiny_model("adamw")
    opt = build_optimizer(cfg.train, model, [("decoder", list(model.decoder.parameters()), 1e-2)])
    assert isinstance(opt, torch.optim.AdamW) and [g["decay"] for g in opt.param_groups] == [True, False]
    decayed, kept = ({id(p) for p in g["params"]} for g in opt.param_groups)
    named = dict(model.decoder.named_parameters())
    assert id(named["embedding.weight"]) in kept and all(id(p) in kept for n, p in named.items() if p.ndim < 2)
    assert all(id(p) in decayed for n, p in named.items() if p.ndim >= 2 and n != "embedding.weight")
    assert opt.param_groups[0]["weight_decay"] == 0.1 and opt.param_groups[1]["weight_decay"] == 0.0
    objective, samples = CrossEntropy(cfg), collate(_tiny_batch(4))

    def step(m, o):
        return train_step(lambda b: objective(m, b), o, samples, cfg, torch.device("cpu"))

    for _ in range(2):
        step(model, opt)
    tensors, info = optimizer_to_tensors(opt)
    twin = copy.deepcopy(model)
    again = build_optimizer(cfg.train, twin, [("decoder", list(twin.decoder.parameters()), 1e-2)])
    roles = [(g["role"], g["decay"]) for g in again.param_groups]
    # copies, as a file gives them (restored tensors of the same type are taken as they are, not copied)
    optimizer_from_tensors(again, {k: v.clone() for k, v in tensors.items()}, json.loads(json.dumps(info)))
    keep_roles(again, roles)
    for _ in range(2):
        step(model, opt), step(twin, again)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    apply_to_optimizer(again, {"train.weight_decay": (0.1, 0.05), "train.lr": (1e-2, 5e-3)})
    assert [(g["weight_decay"], g["lr"]) for g in again.param_groups] == [(0.05, 5e-3), (0.0, 5e-3)]


def test_adam_keeps_one_group_per_rate_with_l2_on_every_parameter():
    from captioner.training.optimizer import build_optimizer

    cfg, model = _tiny_model("adam", 1e-4)
    opt = build_optimizer(cfg.train, model, [("decoder", list(model.decoder.parameters()), 1e-3),
                                             ("encoder", list(model.encoder.parameters()), 1e-4)])
    assert type(opt) is torch.optim.Adam and [(g["role"], g["weight_decay"]) for g in opt.param_groups] == [
        ("decoder", 1e-4), ("encoder", 1e-4)]
    with pytest.raises(ValueError, match="train.optimizer must be one of adam, adamw"):
        load_config(None, ["train.optimizer=sgd"])
