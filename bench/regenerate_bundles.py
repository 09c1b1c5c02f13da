"""Regenerate the committed bundles from bundles/MANIFEST.md's commands into a directory, several at a time, and say
how each compares with the committed file. Run it from the repository root (a maintainer's tool: the regeneration
test, tests/test_bundles.py, is what judges the committed bundles on every CI run):

    python bench/regenerate_bundles.py --out /tmp/regen [--jobs 2] [model_tiny model_int4_tiny ...]

Each command runs as written, but writes into --out; a command that reads another bundle (`--model`, the INT4 tiny
bundle) reads the regenerated one when that one is regenerated too, and runs after it. Each command's console output
goes to OUT/NAME.log. At the end, a table: wall time, sha256, which tensors differ from the committed file's, and
the figures `kdtr gen` stored (forward ratio, full-depth rounds). A bundle's metadata records its command, --out
included: the committed bundles were written to /tmp/regen, so only `--out /tmp/regen` can give their sha256. To
adopt the new files, copy them into bundles/ and update MANIFEST.md's sha256 and figures (and re-make the GPU
proofs: each names its bundle's sha256). Exit status 0 when every command succeeded, 1 otherwise; Ctrl-C stops
every running command.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from conformance.gen.manifest import manifest_commands, plan  # noqa: E402


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _compare(committed: str, new: str) -> tuple[str, dict]:
    """(how `new`'s tensors compare with `committed`'s, new's stored figures). The files themselves always differ:
    the metadata records the command, and so the output path."""
    from kdtr_format import open_kdtr

    with open_kdtr(new) as b:
        figures = dict(b.metadata.get("figures") or {})
        if not os.path.exists(committed):
            return "no committed file", figures
        with open_kdtr(committed) as a:
            if a.names != b.names:
                return "other tensors", figures
            moved = [n for n in a.names if a.info(n).checksum != b.info(n).checksum]
    drafter = [n for n in moved if n.startswith("drafter.")]
    target = [n for n in moved if not n.startswith(("drafter.", "golden/"))]
    if not moved:
        return "every tensor identical", figures
    if target:
        return f"{len(target)} target weights differ", figures
    if drafter:
        return f"drafter differs ({len(drafter)})", figures
    return f"weights identical, {len(moved)} goldens differ", figures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundles", nargs="*", help="bundle names (model_tiny) or paths; default: every bundle")
    ap.add_argument("--out", required=True, help="directory for the regenerated bundles and their logs")
    ap.add_argument("--jobs", type=int, default=2, help="commands run at once (default 2; each uses a core or more)")
    args = ap.parse_args()
    if args.jobs < 1:
        ap.error(f"--jobs {args.jobs}: pass 1 or more")
    try:
        jobs = plan(manifest_commands(), args.out, args.bundles or None)
    except ValueError as e:
        ap.error(str(e))
    os.makedirs(args.out, exist_ok=True)
    waiting, running, done = list(jobs), {}, {}
    t0 = time.monotonic()

    def stamp() -> str:
        return f"{time.monotonic() - t0:7.0f} s"

    try:
        while waiting or running:
            for job in [j for j in waiting if j.after is None or j.after in done]:
                if len(running) >= args.jobs:
                    break
                if job.after and done[job.after][0] != 0:
                    print(f"{stamp()}  skipped {job.bundle}: {job.after} failed", flush=True)
                    done[job.bundle] = (None, 0.0)
                    waiting.remove(job)
                    continue
                log = open(Path(args.out) / (Path(job.bundle).stem + ".log"), "w")
                proc = subprocess.Popen([sys.executable, "-m", "cli.main", *job.argv], cwd=ROOT, stdout=log,
                                        stderr=subprocess.STDOUT)
                running[job.bundle] = (job, proc, log, time.monotonic())
                waiting.remove(job)
                print(f"{stamp()}  started {job.bundle}", flush=True)
            time.sleep(1.0)
            for b, (job, proc, log, start) in list(running.items()):
                if proc.poll() is not None:
                    log.close()
                    done[b] = (proc.returncode, time.monotonic() - start)
                    del running[b]
                    print(f"{stamp()}  {'finished' if proc.returncode == 0 else f'FAILED ({proc.returncode})'} {b} "
                          f"in {done[b][1]:.0f} s", flush=True)
    except KeyboardInterrupt:
        for job, proc, log, _ in running.values():
            proc.terminate()
        for job, proc, log, _ in running.values():
            proc.wait()
            log.close()
        print("interrupted: the running commands were stopped; their outputs are not written", file=sys.stderr)
        return 130
    print(f"\nall in {time.monotonic() - t0:.0f} s wall")
    print(f"{'bundle':36s} {'exit':>4s} {'wall s':>7s}  {'sha256':16s}  {'tensors against committed':30s} figures")
    for job in jobs:
        rc, wall = done[job.bundle]
        if rc is None:
            print(f"{job.bundle:36s}    -       -  skipped: {job.after} failed")
            continue
        if rc != 0:
            print(f"{job.bundle:36s} {rc:4d} {wall:7.0f}  see {Path(args.out) / (Path(job.bundle).stem + '.log')}")
            continue
        how, fig = _compare(str(ROOT / job.bundle), job.out)
        print(f"{job.bundle:36s} {rc:4d} {wall:7.0f}  {_sha256(job.out)[:16]}  {how:30s} "
              f"forward ratio {fig.get('forward_ratio')}, full-depth rounds {fig.get('full_depth_rounds')}")
    return 0 if all(rc == 0 for rc, _ in done.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
