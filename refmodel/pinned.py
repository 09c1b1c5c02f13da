"""Run a CPU computation in a child process whose math libraries are pinned to code paths meant to give the same
floating-point bits on every x86-64 CPU with AVX2, Intel or AMD, with or without AVX-512
(docs/golden-bundles.md, "Regeneration on other CPUs"). Measured not to hold across vendors while training's
matrix products ran on MKL: an AMD EPYC with AVX-512 distilled other drafter bits than an Intel Xeon did, with
every float64 golden the same (that section, "Measured: the pin across vendors"); training's products now run
on NumPy's OpenBLAS (refmodel/distill_torch.py, `_mm`), pinned below, and make no MKL GEMM call. MKL's vector
math (torch's exp and AdamW's sqrt) moved training with MKL's branch on an Intel Xeon; by default NumPy computes
both (refmodel/distill.py, DistillSettings.vector_math "numpy"), and the pinned distillation gave the same weights
on that Intel Xeon and on an AMD EPYC (that section, "Measured on an Intel Xeon"). Drafters distilled with torch's
vector math ("torch", the bundles committed before stop 49) regenerate only on CPUs whose MKL takes their path.

Why: each library picks its kernels by the CPU it finds, and hundreds of optimiser steps turn a last-bit
difference into a different drafter. Three libraries take part in distillation, each pinned here:
- MKL (torch's float32 GEMM, which training no longer calls; kept pinned should any product reach it). MKL
  dispatches by vendor as well as by instruction set: its conditional
  numerical reproducibility branch AVX2 holds only on Intel CPUs; on any other vendor MKL silently takes its
  AUTO branch (MKL's own documentation says so). The COMPATIBLE branch (SSE2 without the approximate
  reciprocals) is the one MKL defines for Intel and Intel-compatible CPUs alike, so it is the pin; it costs
  about 2x in training time on the `tiny` drafter (0.45 -> 0.95 s a step, measured on this 2-core machine).
- torch's own vector kernels (ATen): the AVX2 build, on every CPU (ATEN_CPU_CAPABILITY).
- NumPy (the float64 target runs that make the distillation corpus): NumPy ships AVX-512 versions of exp,
  log, sin, cos, tanh... that round differently from its AVX2 ones (measured here: the corpus's float64
  features differ when only NumPy's AVX-512 targets are disabled). They are disabled, so every AVX2 CPU runs
  the AVX2 targets. Its OpenBLAS runs the Haswell kernels on one thread (a fixed kernel and blocking whatever
  the core count); it also computes training's float32 products.
All are read once, when the library first runs, so they must be set before torch and NumPy start: hence a
fresh process. The child also dies with its parent, however the parent dies (SIGKILL included).
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import signal
import threading
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

import numpy as np

_MARK = "KDTR_PINNED_MATH"


def _numpy_avx512_targets() -> str:
    """NumPy's dispatch targets that need AVX-512 (named X86_V4 and AVX512_* in NumPy 2.x, AVX512F,
    AVX512_SKX, ... in 1.x), space-separated for NPY_DISABLE_CPU_FEATURES."""
    try:
        from numpy._core import _multiarray_umath as umath          # NumPy >= 2
    except ImportError:                                             # pragma: no cover - NumPy 1.x
        from numpy.core import _multiarray_umath as umath
    return " ".join(t for t in umath.__cpu_dispatch__ if t == "X86_V4" or t.startswith("AVX512"))


# Read once at library start-up; AVX2 is the newest instruction set every CI-class x86-64 CPU has.
PINNED_ENV = {
    "MKL_CBWR": "COMPATIBLE,STRICT",    # MKL GEMM: the one branch MKL keeps the same on every vendor
    "ATEN_CPU_CAPABILITY": "avx2",      # torch's own vectorised kernels: the AVX2 build
    "ONEDNN_MAX_CPU_ISA": "AVX2",       # oneDNN (torch's mkldnn ops), should any run: at most AVX2
    "NPY_DISABLE_CPU_FEATURES": _numpy_avx512_targets(),   # NumPy's umath loops: the AVX2 targets
    "OPENBLAS_CORETYPE": "Haswell",     # NumPy's OpenBLAS (the float64 corpus, training's products): AVX2 ...
    "OPENBLAS_NUM_THREADS": "1",        #   ... on one thread, whatever the machine's core count
}


def is_pinned() -> bool:
    """True inside a process started by run_pinned (its libraries were loaded under PINNED_ENV)."""
    return os.environ.get(_MARK) == "1"


def die_with_parent(parent: int) -> None:
    """Exit this process when `parent` goes away: the kernel's parent-death signal (Linux), and a watch thread
    for every other case (the parent-death signal follows the parent thread, and is Linux-only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)                   # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):                   # pragma: no cover - not Linux
        pass
    if os.getppid() != parent:                          # it died before the signal was armed
        os._exit(1)

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)                                     # orphaned: nobody reads our result
    threading.Thread(target=watch, daemon=True, name="kdtr-parent-watch").start()


def _resolve(fn):
    """fn itself, or the function a "package.module:name" string names (imported here, in the child)."""
    if not isinstance(fn, str):
        return fn
    import importlib

    module, _, name = fn.partition(":")
    return getattr(importlib.import_module(module), name)


def _serve(modules, jobs, queue, parent) -> None:
    """The child: import `modules` at once (their libraries load under PINNED_ENV), then run the one call `jobs`
    sends."""
    die_with_parent(parent)

    def progress(*p):
        queue.put(("progress", p))
    try:
        import importlib

        for m in modules:
            importlib.import_module(m)
        fn, args, kwargs = pickle.loads(jobs.recv_bytes())   # (a worker closed without a call is killed here)
        queue.put(("done", _resolve(fn)(*args, progress=progress, **kwargs)))
    except BaseException as e:  # noqa: BLE001 - any failure is re-raised in the parent
        queue.put(("error", e))


class WorkerDied(RuntimeError):
    """A process of the distillation ended without a result: killed by a signal (from outside, or by the
    kernel's out-of-memory killer) or exited on its own. `signal` is the signal number where known."""

    def __init__(self, exitcode: int | None, what: str = "the pinned-math worker process (the distillation)"):
        self.signal = -exitcode if exitcode is not None and exitcode < 0 else None
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = f"signal {self.signal}"
            how = (f"was killed by {name}" + (" (from outside, or by the out-of-memory killer: see `dmesg`)"
                                              if self.signal == signal.SIGKILL else ""))
        elif exitcode is None:
            how = "died (killed from outside, or by the out-of-memory killer: see `dmesg`)"
        else:
            how = f"exited with code {exitcode}"
        super().__init__(f"{what} {how} before returning a result; nothing was written: run the command again")
        self._args = (exitcode, what)

    def __reduce__(self):                               # re-made from its own arguments when sent between processes
        return (type(self), self._args)


class PinnedWorker:
    """A fresh process under PINNED_ENV, started at once, that imports `modules` while the caller goes on
    (`kdtr gen` starts its worker before it builds the target, so that the worker's start-up overlaps the
    target's construction), then runs one call. Not a daemon: it forks helpers of its own
    (refmodel/distill.py make_corpus), which daemons may not; it dies with this process all the same
    (die_with_parent), and `close` (or leaving the `with` block) kills it if it is still running."""

    def __init__(self, modules: tuple[str, ...] = ()):
        ctx = mp.get_context("spawn")                  # a new interpreter: the env applies at library load
        self._jobs, self._send = ctx.Pipe(duplex=False)    # the call, pickled here (call), read there once
        self._queue = ctx.Queue()
        self._used = False
        saved = {k: os.environ.get(k) for k in (*PINNED_ENV, _MARK)}
        os.environ.update(PINNED_ENV, **{_MARK: "1"})
        try:
            self.proc = ctx.Process(target=_serve, args=(tuple(modules), self._jobs, self._queue, os.getpid()),
                                    daemon=False)
            self.proc.start()
            self._jobs.close()                         # the worker's end: a worker that dies unread breaks the pipe
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def __enter__(self) -> "PinnedWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def call(self, fn: "Callable[..., Any] | str", *args, progress=None, **kwargs) -> Any:
        """fn(*args, progress=..., **kwargs) in the worker (fn a picklable function, or "module:name", which
        then need not be imported here); progress calls are forwarded to `progress`; fn's result (picklable)
        is returned and its exception re-raised here. One call per worker; the worker is closed when it ends,
        by a result or by an exception (Ctrl-C included)."""
        if self._used:
            raise RuntimeError("a PinnedWorker runs one call; start another")
        self._used = True
        proc, queue = self.proc, self._queue
        finished = False
        try:
            try:                                       # pickled here, not by a queue's feeder thread, which
                job = ForkingPickler.dumps((fn, args, kwargs))   # would lose the error and leave us waiting forever
            except (pickle.PicklingError, TypeError, AttributeError) as e:
                raise TypeError(f"the pinned worker cannot be sent {getattr(fn, '__qualname__', fn)!r} and its "
                                f"arguments: {e}") from e
            try:                                       # one copy of the arguments, written as the worker reads it
                self._send.send_bytes(job)
            except (BrokenPipeError, ConnectionResetError):
                proc.join(timeout=10)                  # it died before it read its call
                raise WorkerDied(proc.exitcode) from None
            del job
            while True:
                try:
                    kind, value = queue.get(timeout=1.0)
                except queue_mod.Empty:
                    if not proc.is_alive():            # died without a word (killed, out of memory)
                        raise WorkerDied(proc.exitcode) from None
                    continue
                if kind == "progress":
                    if progress:
                        progress(*value)
                    continue
                finished = True                        # the child has nothing left to do but exit
                if kind == "error":
                    raise value
                return value
        finally:
            if finished:
                proc.join(timeout=10)
            self.close()

    def close(self) -> None:
        """Kill the worker if it still runs (interrupted, stuck, or never given a call) and reap it."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)
        self._send.close()                              # a call the worker never read: nothing waits on it


def run_pinned(fn: "Callable[..., Any] | str", *args, progress=None, **kwargs) -> Any:
    """fn(*args, progress=..., **kwargs) in a fresh process under PINNED_ENV (PinnedWorker.call): its result
    returned, its exception re-raised here; the child is killed when this call ends by an exception (Ctrl-C
    included) and dies on its own if this process dies."""
    with PinnedWorker() as worker:
        return worker.call(fn, *args, progress=progress, **kwargs)
