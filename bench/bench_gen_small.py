"""How long a small `kdtr gen` takes, and that its log can be read while it runs.

    python bench/bench_gen_small.py [--goal 30] [-- EXTRA GEN OPTIONS]

Runs `kdtr gen --num-prompts 1 --max-new-tokens 8 --distill-steps 20` (the quick try of a new user) as a
child process with stderr to a log file, as CI runs it, and reports: wall time and its ratio to the goal
(30 s on a 2-core machine: a speed goal is a ratio here, never a timed test), when the log's first line
appeared (progress is written while the run goes on, not when a stage ends), the peak resident memory of
the largest process of the run (the pinned distillation worker included), and the time per stage from the
log. Before the corpus was sized by the distillation (refmodel/distill.py, corpus_size) this command
built 1280 streams whatever the step count: 3:47 and 1.2 GB, 208 s of it the corpus.
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND = ["gen", "--num-prompts", "1", "--max-new-tokens", "8", "--distill-steps", "20"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--goal", type=float, default=30.0, help="seconds the run should stay well under")
    ap.add_argument("extra", nargs="*", help="more kdtr gen options (after --)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        log, out = os.path.join(d, "gen.log"), os.path.join(d, "small.kdtr")
        argv = [sys.executable, "-m", "cli.main", *COMMAND, *args.extra, "--out", out]
        t0 = time.monotonic()
        with open(log, "w") as fh:
            proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=fh,
                                    env={**os.environ, "PYTHONPATH": ROOT})
            first = None
            while proc.poll() is None:
                if first is None and os.path.getsize(log) > 0:
                    first = time.monotonic() - t0
                time.sleep(0.05)
        wall = time.monotonic() - t0
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024      # Linux: KiB -> MiB
        lines = open(log).read().splitlines()
        if proc.returncode != 0:
            print("\n".join(lines[-20:]))
            sys.exit(f"kdtr gen exited {proc.returncode}")
        size = os.path.getsize(out)
    print(f"kdtr {' '.join(COMMAND + args.extra)}  ({os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f})")
    print(f"  wall {wall:.1f} s = {wall / args.goal:.2f} x the {args.goal:.0f} s goal; bundle {size / 2**20:.1f} MiB")
    print(f"  first log line after {first if first is None else round(first, 1)} s; {len(lines)} lines")
    print(f"  peak resident memory of the largest process: {peak:.0f} MiB")
    for ln in lines:
        if ln.rstrip().endswith("done"):
            print("   ", ln.strip())


if __name__ == "__main__":
    main()
