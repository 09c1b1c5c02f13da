"""Wall time of a sharded verify (`kdtr verify BUNDLE --engine torch --tp N [--ep M]`) on this machine, against
the same engine at TP 1 in the same run: one process, no collective, the floor every sharded run pays. The
ratio is what N rank processes and their collectives cost on these cores (on a 2-core machine four ranks
share two cores, so TP 4 cannot be faster than TP 1; the ratio says by how much it is slower). `ranks s` is the
rank processes' part (their start, one torch import, and the run), `judge s` the rank-by-rank judging.

    python bench/bench_sharded.py BUNDLE [--plans 1x1,2x1,4x1,1x4,2x2] [--repeat 2]

BUNDLE: a shardable bundle (kdtr gen --preset shardable; bundles/MANIFEST.md).
"""
import argparse
import os
import platform
import time

from conformance.verify.runner import verify
from conformance.verify.shard_run import ShardedTorchEngine


def best_of(fn, n: int):
    best, out = None, None
    for _ in range(n):
        t = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t
        best = dt if best is None or dt < best else best
    return best, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--plans", default="1x1,2x1,4x1,1x4,2x2", help="TPxEP, comma-separated (default: %(default)s)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per plan, the best kept (default: %(default)s)")
    a = ap.parse_args()
    plans = [tuple(int(x) for x in p.split("x")) for p in a.plans.split(",")]
    print(f"{a.bundle} on {platform.node()}: {os.cpu_count()} CPU(s), load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"{'plan':>7} {'ranks':>5} {'verify s':>9} {'ranks s':>8} {'judge s':>8} {'vs TP 1':>8}  verdict")
    base = None
    for tp, ep in plans:
        t, v = best_of(lambda: verify(a.bundle, engine=ShardedTorchEngine(tp, ep)), a.repeat)
        base = t if (tp, ep) == (1, 1) else base
        ratio = f"{t / base:7.2f}x" if base else "       -"
        print(f"{tp}x{ep:<5} {max(tp, ep):5} {t:9.2f} {v.info.get('engine_seconds', 0):8.2f} "
              f"{v.info.get('judge_seconds', 0):8.2f} {ratio}  exit {int(v.exit_code)}, {len(v.checks)} checks")


if __name__ == "__main__":
    main()
