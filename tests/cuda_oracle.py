"""Shared helpers of the GPU kernel tests: the device fixture and the one comparison every op test uses.

A GPU result is judged against the float64 oracle (refmodel's own functions where they exist) with a
tolerance derived from the same-precision baseline: the same oracle function run in float32 NumPy.
"""
from __future__ import annotations

import glob
import os

import numpy as np
import pytest

# bundles/*.kdtr made on demand and never committed (bundles/MANIFEST.md): no proof, no GPU test over them
NOT_COMMITTED = ("k26_slice.kdtr",)


def committed_bundles() -> list[str]:
    """The committed bundles (every bundles/*.kdtr but the real-shape slice, which a user may have made)."""
    return sorted(b for b in glob.glob("bundles/*.kdtr") if os.path.basename(b) not in NOT_COMMITTED)


def moe_launches(D: int, I: int, E: int, K: int, sm: int, moe: bool = True, tokens=range(1, 65)) -> list[tuple]:
    """(path, weight, T, entry, blocks, k splits, regime) of the CUDA engine's fast MoE launches for hidden D,
    expert width I, E experts top-K: the decode step and every forward of 2..64 tokens (prefill, a tree verify),
    a pair per z up to w4a16_plan.MOE_PAIRS_MAX_TOKENS, above on the grouped path (moe_path), planned by
    cuda_engine/w4a16_plan.py on a GPU of `sm` SMs with the one-token entry at 3 blocks per SM and the others at 2 (docs/cuda-engine.md). moe=False: as the
    planner chose before the MoE paths had their own row counts (every row count, the single-weight regime)."""
    from cuda_engine.w4a16_plan import (W4A16_DIGITS_ROWS, W4A16_ROWS, moe_path, w4a16_groups_cap, w4a16_launch,
                                        w4a16_rows_regime)

    res = lambda name: (3 if name in W4A16_ROWS[1].values() else 2) * sm    # noqa: E731
    out = []
    for weight, Nb, G in (("gate_up", -(-I // 16), D // 32), ("down", -(-D // 32), I // 32)):  # 16 rows a block
        for T in tokens:
            if moe_path(T) == "pairs":
                plan = w4a16_launch(Nb, G, T * K, None, 1, "fp32", None, False, res, sm, moe=moe)
            elif moe:
                plan = w4a16_launch(Nb, G, w4a16_groups_cap(T * K, E, 4), None, 4, "fp32", None, True, res, sm)
            else:                                  # the grouped digits over 1, 2, 4, 8 row blocks, as before
                r, k, regime = w4a16_rows_regime(Nb, G, w4a16_groups_cap(T * K, E, 4), res(W4A16_DIGITS_ROWS[1]),
                                                 sm, 4, (1, 2, 4, 8))
                plan = (W4A16_DIGITS_ROWS[1] + (f"_r{r}" if r > 1 else ""), -(-Nb // r), k, regime)
            out.append((moe_path(T), weight, T, *plan))
    return out

FACTOR = 4.0      # a GPU fp32 result may be at most this many times further from float64 than NumPy fp32


def gpu_ops():
    """The kernel module on the GPU, or a clean skip (no pycuda, no device)."""
    pytest.importorskip("pycuda.driver", reason="pycuda is not installed")
    from cuda_engine.device import CudaEngineError, driver

    try:
        driver()
    except CudaEngineError as e:
        pytest.skip(str(e))
    from cuda_engine.ops import Ops

    return Ops()


def check(case: str, got, oracle, baseline, factor: float = FACTOR) -> None:
    """max |got - oracle| <= factor x max |baseline - oracle| (floor: one float32 ulp of the oracle's scale)."""
    got, oracle, baseline = (np.asarray(a, np.float64) for a in (got, oracle, baseline))
    assert got.shape == oracle.shape, f"{case}: shape {got.shape} != oracle {oracle.shape}"
    err = np.abs(got - oracle)
    base = float(np.max(np.abs(baseline - oracle))) if oracle.size else 0.0
    scale = float(np.max(np.abs(oracle))) if oracle.size else 0.0
    tol = factor * max(base, np.finfo(np.float32).eps * max(scale, 1e-30))
    nmse = float(np.sum(err ** 2) / max(np.sum(oracle ** 2), 1e-300))
    assert err.size == 0 or err.max() <= tol, (
        f"{case}: max abs err {err.max():.3g}, mean {err.mean():.3g}, NMSE {nmse:.3g} > tol {tol:.3g} "
        f"({factor} x fp32 NumPy baseline {base:.3g})")


def rand(rng, *shape, scale=1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)
