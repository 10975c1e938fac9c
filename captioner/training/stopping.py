"""Stopping a run on request (Ctrl-C = SIGINT, a scheduler's or spot instance's SIGTERM) without losing a step.

The command (cli/train.py) installs `StopSignal.catch()`; the engine asks `pending()` after every optimiser
step, saves the exact step and raises `Interrupted`, which the command turns into one line and exit code
128 + signal (130 / 143). Outside the training loop (cache building, validation, a checkpoint being written)
nothing is half-done that a rerun cannot redo, so the request raises `Interrupted` at once and the
writers' `finally` blocks remove their temporary files.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:  # torch is imported where it is used: the command installs catch() before torch is loaded
    import torch

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """A stop asked for by a signal (a BaseException, like KeyboardInterrupt: `except Exception` lets it by).
    `where` says what was saved ("stopped at epoch 2, step 340"); `code` is the process exit status."""

    def __init__(self, signum: int, where: str = ""):
        self.signum, self.where = signum, where
        super().__init__(where or signal.Signals(signum).name)

    @property
    def code(self) -> int:
        return 128 + self.signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


class StopSignal:
    """The stop request of one process. `deferred()`: inside it a signal only records the request (the training
    loop finishes its step and saves); outside it the signal raises Interrupted where the program is."""

    def __init__(self) -> None:
        self.signum = 0
        self._defer = 0

    def request(self, signum: int, _frame=None) -> None:
        self.signum = self.signum or signum
        if not self._defer:
            raise Interrupted(signum)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._defer += 1
        try:
            yield
        finally:
            self._defer -= 1

    def pending(self, world_size: int = 1, device: torch.device | None = None) -> int:
        """The signal to stop on, 0 if none. With several ranks every rank stops at the same step: one that was
        signalled tells the others (a max over the ranks, one tiny all-reduce a step)."""
        if world_size <= 1:
            return self.signum
        import torch
        import torch.distributed as dist

        flag = torch.tensor([self.signum], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    @contextlib.contextmanager
    def catch(self) -> Iterator["StopSignal"]:
        """Route SIGINT and SIGTERM to request() for the block (the commands' edge; restored after). An
        Interrupted raised where Python cannot raise (a weakref callback, __del__: "Exception ignored in") would be
        lost; the unraisable hook has the signal sent again a moment later (from a timer thread: the hook itself
        cannot raise either), so it is raised in ordinary code instead."""
        old = {s: signal.signal(s, self.request) for s in SIGNALS}
        old_hook = sys.unraisablehook

        def again(unraisable) -> None:
            if isinstance(unraisable.exc_value, Interrupted):
                threading.Timer(0.05, os.kill, (os.getpid(), unraisable.exc_value.signum)).start()
            else:
                old_hook(unraisable)

        sys.unraisablehook = again
        try:
            yield self
        finally:
            sys.unraisablehook = old_hook
            for s, handler in old.items():
                signal.signal(s, handler)


NEVER = StopSignal()  # fit() without a stop signal (the library, the tests): nothing ever requests a stop
