"""Probe: where does the pinned distillation depend on the CPU vendor? (docs/golden-bundles.md, "Measured: the pin
across vendors"). Run it from the repository root on any x86-64 CPU with AVX2:

    python bench/probe_distill_vendor.py [--steps 30]

It runs the small pinned distillation of tests/test_distill_pinned.py (the MICRO target, 8 sequences, 30 steps)
in the pinned worker, three ways, each under MKL's COMPATIBLE branch (the pin) and its AUTO branch:
- `openblas`: as the bundles committed before stop 50 were distilled (`kdtr gen --distill-math torch`): every
  matrix product of the drafter's forward and backward computed by NumPy in float32 (refmodel/distill_torch.py, `_mm`), that is by NumPy's
  OpenBLAS on its pinned Haswell kernels, one thread; the loss weights' exp and AdamW's square root by torch (MKL's
  vector math);
- `mkl`: as `kdtr gen` trained before stop 37: torch's own matrix products too, through MKL;
- `numpy-math`: as `kdtr gen` trains by default since stop 49: `openblas` with the exp and the square root by NumPy
  too (no MKL vector math; DistillSettings.vector_math "numpy"). It gave `0970a55bc215d5f0` under both branches on
  an Intel Xeon (stop 48) and on an AMD EPYC (stop 49): the default distils the same drafters on both vendors.
For each it prints the corpus digest, the weights digest and the MKL calls the run made (MKL_VERBOSE). What to
read: `openblas` makes no MKL GEMM call, yet its weights moved with MKL's branch on an Intel Xeon (its vector math);
`numpy-math` makes no MKL call of any kind. Compare a CPU's digests with the ones docs/golden-bundles.md records:
`numpy-math` weights equal to `0970a55bc215d5f0` say that the committed drafters (NumPy's math since stop 50)
regenerate on that CPU; `openblas` weights equal to `ac2b868b449ed9f2` (an AMD EPYC) say the same of the drafters
committed before stop 50.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def _route_through_mkl():
    """Training's products back on torch's own matmul (MKL), as `kdtr gen` trained before stop 37."""
    import torch

    from refmodel import distill_torch

    distill_torch._mm = torch.matmul


def _probe(route: str, branch: str, steps: int, progress=None):
    """(corpus digest, weights digest, MKL calls by function) of the small distillation, in the pinned child,
    under MKL branch `branch` (set here, before torch loads MKL: the worker starts under the pin's COMPATIBLE)."""
    os.environ["MKL_CBWR"] = branch
    out = tempfile.TemporaryFile()
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(out.fileno(), 1)                       # MKL_VERBOSE prints to fd 1: count its lines
    try:
        from refmodel.distill import distill_drafter, make_corpus
        from refmodel.weights import init_weights
        from test_ddtree_verify import MICRO, MICRO_DRAFTER
        from test_distill_pinned import SMALL, _digest

        if route == "mkl":
            _route_through_mkl()
        settings = dataclasses.replace(SMALL, vector_math="numpy" if route == "numpy-math" else "torch")
        W = init_weights(MICRO, 1)
        ids, feats, plens = make_corpus(MICRO, W, MICRO_DRAFTER, 3, SMALL)
        corpus = _digest({"ids": ids, "feats": feats, "plens": plens})
        weights = _digest(distill_drafter(MICRO, W, MICRO_DRAFTER, seed=3, steps=steps, settings=settings))
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
    out.seek(0)
    calls: dict[str, int] = {}
    for line in out.read().decode(errors="replace").splitlines():
        name = line.split()[1].split("(")[0] if line.startswith("MKL_VERBOSE ") else ""
        if name.isupper():                         # a function call (the first line is MKL's version banner)
            calls[name] = calls.get(name, 0) + 1
    return corpus, weights, calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="training steps (default 30, as the pin's test)")
    args = ap.parse_args()
    from refmodel.pinned import run_pinned

    import platform
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"CPU: {cpu} ({platform.machine()}); {args.steps} steps")
    os.environ["MKL_VERBOSE"] = "1"
    for route in ("mkl", "openblas", "numpy-math"):
        for branch in ("COMPATIBLE,STRICT", "AUTO"):
            corpus, weights, calls = run_pinned(_probe, route, branch, args.steps)
            print(f"{route:10s} MKL_CBWR={branch:17s} corpus {corpus[:16]}  weights {weights[:16]}  MKL calls "
                  f"{dict(sorted(calls.items())) or 'none'}")


if __name__ == "__main__":
    main()
