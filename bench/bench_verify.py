"""How long `kdtr verify` takes on the committed bundles with the reference engine (target: seconds,
not minutes, on a 2-core machine). Baseline in the same run: opening the bundle and checking every
checksum, the floor any verify pays; the ratio says how much the engine run and the judging add.

    python bench/bench_verify.py [BUNDLE ...]
"""
import sys
import time

from conformance.engines.reference_engine import ReferenceEngine
from conformance.verify.runner import verify
from kdtr_format import open_kdtr

BUNDLES = ["bundles/model_tiny.kdtr", "bundles/model_int4_tiny.kdtr"]


def best_of(fn, n=3) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main(paths):
    total = 0.0
    print(f"{'bundle':34} {'checksums s':>12} {'verify s':>9} {'engine s':>9} {'judge s':>8} {'ratio':>6}")
    for path in paths:
        def checks():
            with open_kdtr(path, verify=True):
                pass
        base = best_of(checks)
        v = None

        def run():
            nonlocal v
            v = verify(path, engine=ReferenceEngine())
        t = best_of(run)
        total += t
        print(f"{path:34} {base:12.3f} {t:9.3f} {v.info['engine_seconds']:9.3f} {v.info['judge_seconds']:8.3f} "
              f"{t / base:6.1f}  exit {int(v.exit_code)}, {len(v.checks)} checks")
    print(f"both bundles: {total:.2f} s")


if __name__ == "__main__":
    main(sys.argv[1:] or BUNDLES)
