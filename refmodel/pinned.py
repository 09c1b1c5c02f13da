"""Run a CPU computation in a child process whose math libraries are pinned to one instruction set, so
its floating-point results are the same bits on every x86-64 CPU with AVX2 (docs/golden-bundles.md,
"Regeneration on other CPUs").

Why: torch picks its vector kernels (ATen) and MKL picks its GEMM kernels by the CPU it finds. An
AVX-512 machine and an AVX2 machine then round differently, and hundreds of optimiser steps turn a
last-bit difference into a different drafter (measured: 20 distillation steps already give other
weights when only ATEN_CPU_CAPABILITY or MKL_ENABLE_INSTRUCTIONS changes). MKL's conditional numerical
reproducibility (MKL_CBWR) and ATen's capability override fix both to the AVX2 code paths; both are read
once, when the library first runs, so they must be set before torch starts: hence a fresh process.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
from typing import Any, Callable

# Read once at library start-up; AVX2 is the newest instruction set every CI-class x86-64 CPU has.
PINNED_ENV = {
    "MKL_CBWR": "AVX2,STRICT",          # MKL GEMM: the AVX2 code path, bitwise reproducible
    "ATEN_CPU_CAPABILITY": "avx2",      # torch's own vectorised kernels: the AVX2 build
    "OPENBLAS_CORETYPE": "Haswell",     # numpy's OpenBLAS (the corpus' float64 target runs): AVX2 kernels
}
_MARK = "KDTR_PINNED_MATH"


def is_pinned() -> bool:
    """True inside a process started by run_pinned (its libraries were loaded under PINNED_ENV)."""
    return os.environ.get(_MARK) == "1"


def _child(fn, args, kwargs, queue) -> None:
    def progress(*p):
        queue.put(("progress", p))
    try:
        queue.put(("done", fn(*args, progress=progress, **kwargs)))
    except BaseException as e:  # noqa: BLE001 - any failure is re-raised in the parent
        queue.put(("error", e))


def run_pinned(fn: Callable[..., Any], *args, progress=None, **kwargs) -> Any:
    """fn(*args, progress=..., **kwargs) in a fresh process under PINNED_ENV; progress calls are forwarded
    to `progress`; fn's result (picklable) is returned and its exception re-raised here."""
    ctx = mp.get_context("spawn")                      # a new interpreter: the env applies at library load
    queue = ctx.Queue()
    saved = {k: os.environ.get(k) for k in (*PINNED_ENV, _MARK)}
    os.environ.update(PINNED_ENV, **{_MARK: "1"})
    try:
        proc = ctx.Process(target=_child, args=(fn, args, kwargs, queue), daemon=True)
        proc.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        while True:
            try:
                kind, value = queue.get(timeout=1.0)
            except queue_mod.Empty:
                if not proc.is_alive():                # died without a word (killed, out of memory)
                    raise RuntimeError(f"the pinned-math worker process exited with code {proc.exitcode} "
                                       "before returning a result") from None
                continue
            if kind == "progress":
                if progress:
                    progress(*value)
                continue
            if kind == "error":
                raise value
            return value
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
