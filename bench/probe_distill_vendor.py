"""Probe: where does the pinned distillation depend on the CPU vendor? (docs/golden-bundles.md, "Measured: the pin
across vendors"). Run it from the repository root on any x86-64 CPU with AVX2:

    python bench/probe_distill_vendor.py [--steps 30]

It runs the small pinned distillation of tests/test_distill_pinned.py (the MICRO target, 8 sequences, 30 steps)
in the pinned worker, two ways, each under MKL's COMPATIBLE branch (the pin) and its AUTO branch:
- `mkl`: as `kdtr gen` trains (torch's matrix products through MKL);
- `openblas`: the same training with every matrix product of the drafter's forward and backward (`@` and the two
  attention einsums) computed by NumPy in float32, that is by NumPy's OpenBLAS on its pinned Haswell kernels, one
  thread (the library whose float64 products gave the same bits on an Intel Xeon and an AMD EPYC).
For each it prints the corpus digest, the weights digest and the MKL calls the run made (MKL_VERBOSE). What to
read: `openblas` makes no MKL GEMM call, so its weights cannot depend on MKL's branch (COMPATIBLE == AUTO there);
run it on a CPU of the other vendor and compare its digests with the ones docs/golden-bundles.md records: equal
`openblas` weights there and unequal `mkl` weights settle whether MKL is what separates the vendors. The route is
a probe, not the training `kdtr gen` runs: switching would change every committed drafter.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def _route_through_numpy():
    """Replace torch's `@` and the drafter's two attention einsums by NumPy float32 products, gradients included."""
    import numpy as np
    import torch

    def unbroadcast(g, shape):                      # sum the broadcast leading axes (NumPy's fixed pairwise sums)
        while g.ndim > len(shape):
            g = g.sum(0)
        return g

    class NpMatmul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return torch.from_numpy(np.ascontiguousarray(np.matmul(a.detach().numpy(), b.detach().numpy())))

        @staticmethod
        def backward(ctx, g):
            a, b = ctx.saved_tensors
            gn, an, bn = g.contiguous().numpy(), a.detach().numpy(), b.detach().numpy()
            ga = unbroadcast(np.matmul(gn, np.swapaxes(bn, -1, -2)), a.shape)
            gb = unbroadcast(np.matmul(np.swapaxes(an, -1, -2), gn), b.shape)
            return torch.from_numpy(np.ascontiguousarray(ga)), torch.from_numpy(np.ascontiguousarray(gb))

    plain_einsum = torch.einsum

    def einsum(eq, *ops):
        if eq == "nqhd,nshd->nhqs":                 # scores: [n, h, q, d] @ [n, h, d, s]
            q, k = ops
            return NpMatmul.apply(q.permute(0, 2, 1, 3), k.permute(0, 2, 3, 1))
        if eq == "nhqs,nshd->nqhd":                 # p v: [n, h, q, s] @ [n, h, s, d] -> [n, q, h, d]
            p, v = ops
            return NpMatmul.apply(p, v.permute(0, 2, 1, 3)).permute(0, 2, 1, 3)
        return plain_einsum(eq, *ops)

    torch.Tensor.__matmul__ = lambda a, b: NpMatmul.apply(a, b)
    torch.einsum = einsum


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

        import torch  # noqa: F401 - loaded before the route patches it
        if route == "openblas":
            _route_through_numpy()
        W = init_weights(MICRO, 1)
        ids, feats, plens = make_corpus(MICRO, W, MICRO_DRAFTER, 3, SMALL)
        corpus = _digest({"ids": ids, "feats": feats, "plens": plens})
        weights = _digest(distill_drafter(MICRO, W, MICRO_DRAFTER, seed=3, steps=steps, settings=SMALL))
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
    for route in ("mkl", "openblas"):
        for branch in ("COMPATIBLE,STRICT", "AUTO"):
            corpus, weights, calls = run_pinned(_probe, route, branch, args.steps)
            print(f"{route:8s} MKL_CBWR={branch:17s} corpus {corpus[:16]}  weights {weights[:16]}  MKL calls "
                  f"{dict(sorted(calls.items())) or 'none'}")


if __name__ == "__main__":
    main()
