"""A second device emulated on the CPU, to find device-placement mistakes without a GPU.

On a GPU, a tensor made without `device=` lives on the CPU while the model and its inputs live on the GPU,
and an operation that mixes them stops ("Expected all tensors to be on the same device"). `HostTensors`
(a TorchFunctionMode) keeps that distinction while everything really runs on the CPU: a tensor made by a
factory function without a device (torch.tensor, zeros, arange, randn, from_numpy ...) is a host tensor; so
is whatever is computed from host tensors alone; `.to(device or tensor)`, `.cuda()` and `x.new_*` /
`*_like(x)` move it to the device side. An operation mixing a host tensor of one or more dimensions with a
device tensor raises, as CUDA would (a 0-dim host tensor is a scalar CUDA accepts; a host tensor may index a
device tensor, as CUDA allows, and be copied into a slice of one, but not be written through advanced indexing,
which is index_put_).
"""
from __future__ import annotations

import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from captioner.model.graphs import READS_BACK

FACTORIES = {torch.tensor, torch.as_tensor, torch.from_numpy, torch.zeros, torch.ones, torch.empty, torch.full,
             torch.arange, torch.linspace, torch.eye, torch.randn, torch.rand, torch.randint, torch.randperm,
             torch.scalar_tensor}
LIKE = {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like, torch.randn_like}
NEW = {"new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"}
MOVES = {"to", "cuda", "type_as"}


class DeviceMismatch(AssertionError):
    pass


class HostTensors(TorchFunctionMode):
    """with HostTensors(model, *inputs): the modules' parameters and buffers and the given inputs are on the device;
    so is a tensor computed from one of them, moved with `.to(device or tensor)` / `.cuda()`, made with an explicit
    `device=` or with `x.new_*` / `*_like(x)` of a device tensor. A tensor made by a factory without a device is on
    the host, and so is one computed from host tensors only. Tensors made before (caches) are unknown: never an
    error, and an operation takes the side of the tensors it knows."""

    def __init__(self, *on_device):
        super().__init__()
        self.side: dict[int, tuple[weakref.ref, str]] = {}
        for x in on_device:
            self._mark([*x.parameters(), *x.buffers()] if isinstance(x, torch.nn.Module) else x, "device")

    def __enter__(self):
        # a module's parameters and buffers move with it (module.to(device)): they are the device's wherever
        # they were made; buffers are recognised as they are registered
        self._register = torch.nn.Module.register_buffer
        mode = self

        def register_buffer(module, name, tensor, *args, **kwargs):
            mode._mark(tensor, "device")
            return mode._register(module, name, tensor, *args, **kwargs)

        torch.nn.Module.register_buffer = register_buffer
        return super().__enter__()

    def __exit__(self, *exc):
        torch.nn.Module.register_buffer = self._register
        return super().__exit__(*exc)

    def side_of(self, t) -> str | None:
        if isinstance(t, torch.nn.Parameter):
            return "device"
        entry = self.side.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def _mark(self, out, side: str | None) -> None:
        if side is None:
            return
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.side[id(t)] = (weakref.ref(t), side)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        named_device = kwargs.get("device") is not None
        if func in FACTORIES:
            self._mark(out, "device" if named_device else "host")
        elif func in LIKE or name in NEW:  # the side of the tensor it is made like, unless a device is named
            self._mark(out, "device" if named_device else self.side_of(args[0]))
        elif name in MOVES:
            moved = name == "cuda" or named_device or any(isinstance(a, (str, torch.device)) for a in args[1:]) \
                or any(self.side_of(t) == "device" for t in tensors[1:])
            self._mark(out, "device" if moved else self.side_of(args[0]))  # on the CPU a move may return itself
        elif name == "__getitem__":  # a host index into a device tensor is allowed (CUDA copies it)
            self._mark(out, self.side_of(args[0]))
        elif name == "__setitem__":  # advanced indexing (index_put_) needs the value on the tensor's side
            value = args[2] if len(args) > 2 else None  # (basic slicing copies across devices, as copy_ does)
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            advanced = any(isinstance(i, (list, torch.Tensor)) for i in index)
            if advanced and isinstance(value, torch.Tensor) and value.dim() > 0 \
                    and {self.side_of(value), self.side_of(args[0])} == {"host", "device"}:
                raise DeviceMismatch(f"{name}: a {self.side_of(value)} tensor of shape {tuple(value.shape)} written "
                                     f"into a {self.side_of(args[0])} tensor of shape {tuple(args[0].shape)}")
        else:
            sides = {self.side_of(t) for t in tensors if t.dim() > 0 or self.side_of(t) == "device"}
            if {"host", "device"} <= sides:
                shapes = {s: [tuple(t.shape) for t in tensors if self.side_of(t) == s][:3] for s in ("host", "device")}
                raise DeviceMismatch(f"{name}: host tensor(s) {shapes['host']} mixed with device tensor(s) "
                                     f"{shapes['device']}")
            self._mark(out, "device" if "device" in sides else "host" if "host" in sides else None)
        return out


class HostSync(AssertionError):
    pass


SYNCS = READS_BACK  # the reads a recorded search refuses too (captioner/model/graphs.py)


class NoHostSync(TorchFunctionMode):
    """Raises at any call that makes a GPU wait for its queue before the host can go on (reading a value back:
    .item(), .tolist(), bool(t), nonzero(), .cpu() ...): code run under it can be queued step after step."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNCS:
            raise HostSync(f"{name}: reads a tensor back to the host")
        return func(*args, **(kwargs or {}))
