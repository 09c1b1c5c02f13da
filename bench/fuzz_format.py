"""Long fuzz run of the .kdtr reader (outside CI): the cases of tests/test_format_fuzz.py, by the
hundred thousand, plus hostile headers at the size limits. Not a test: run it by hand,

    nice python bench/fuzz_format.py --cases 100000 [--seed 1] [--keep DIR]
    python bench/fuzz_format.py --hostile

Per case it records the outcome (clean open, or which KdtrError), the wall time and the tracemalloc
peak above the case's starting point. It reports every exception other than KdtrError (target: 0;
with --keep the offending files are saved for replay), the slowest case (target: none over 5 s) and
the largest peak (target: none over 200 MB), and the process's RSS growth over the run.

--hostile builds headers that cost the parser the most per byte, at the limits of
docs/kdtr-format.md (64 MiB, 2^22 structural characters, 64 levels), plus a full-size K2.6 bundle
directory, and reports the time and peak memory of opening each.
"""
import argparse
import hashlib
import os
import random
import resource
import struct
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from format_mutations import base_files, mutate  # noqa: E402
from test_format_fuzz import run_case  # noqa: E402

from kdtr_format import KdtrError, open_kdtr  # noqa: E402
from kdtr_format.spec import MAX_HEADER_BYTES, MAX_JSON_ITEMS  # noqa: E402


def fuzz(cases: int, seed: int, keep: str | None) -> int:
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    bad: list[str] = []
    worst_t = worst_m = (0.0, -1)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        bases = base_files(Path(d))
        tracemalloc.start()
        for case in range(cases):
            base = rng.choice(bases)
            kind, data = mutate(rng, base)
            path = Path(d) / f"case{case}.kdtr"
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            t0 = time.perf_counter()
            try:
                outcome = run_case(path, data, kind, base)
            except Exception as e:  # the point of the run: anything but KdtrError is a reader bug
                outcome = "BUG"
                bad.append(f"case {case} (kind {kind}): {type(e).__name__}: {e}"[:300])
                if keep:
                    os.makedirs(keep, exist_ok=True)
                    Path(keep, f"case{case}.kdtr").write_bytes(data)
            dt = time.perf_counter() - t0
            peak = tracemalloc.get_traced_memory()[1] - before
            worst_t, worst_m = max(worst_t, (dt, case)), max(worst_m, (peak, case))
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            path.unlink()
            if (case + 1) % 10000 == 0:
                print(f"  {case + 1} cases, {time.perf_counter() - t_start:.0f} s, "
                      f"{len(bad)} non-KdtrError", flush=True)
        tracemalloc.stop()
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"cases {cases} (seed {seed}) in {time.perf_counter() - t_start:.0f} s")
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items(), key=lambda kv: -kv[1])))
    print(f"exceptions other than KdtrError: {len(bad)}")
    for line in bad[:20]:
        print("  " + line)
    print(f"max time per case: {worst_t[0] * 1e3:.1f} ms (case {worst_t[1]})")
    print(f"max tracemalloc peak per case: {worst_m[0] / 2**20:.2f} MiB (case {worst_m[1]})")
    print(f"process max RSS: {rss0 / 1024:.0f} MiB at start, {rss1 / 1024:.0f} MiB at end")
    return 1 if bad else 0


def _file(path: Path, header: bytes) -> None:
    """A file with no tensors and this header (sealed: only the parser can object)."""
    fields = struct.pack("<8sHHIQQ", b"KDTR\r\n\x1a\n", 1, 0, 0x0A0B0C0D, 64, len(header))
    path.write_bytes(fields + hashlib.sha256(fields + header).digest() + header)


def _k26_directory() -> bytes:
    """The directory of a full K2.6 bundle: 139,095 weight tensors (INT4 experts as .qw/.sc pairs)
    and 8 prompts of goldens, entries shaped as the writer writes them (data not needed)."""
    import json

    from refmodel.config import PRESETS
    from refmodel.weights import expected_shapes
    entries, pos = [], 64

    def add(name, dtype, shape, size, **extra):
        nonlocal pos
        nbytes = size * shape[0] * (shape[1] if len(shape) > 1 else 1)
        entries.append(dict(name=name, dtype=dtype, shape=list(shape), offset=pos, nbytes=nbytes,
                            sha256="0" * 64, **extra))
        pos = -(-(pos + nbytes) // 64) * 64
    for name, shape in expected_shapes(PRESETS["k26"]).items():
        if ".experts." in name and name.endswith("_proj.weight"):
            o, i = shape
            add(name[:-7] + ".qw", "int32", (o, i // 8), 4, int4_shape=[o, i])
            add(name[:-7] + ".sc", "bfloat16", (o, i // 32), 2)
        else:
            add(name, "bfloat16", shape, 2)
    for p in range(8):
        for k in range(1000):   # ~61 layers x 16 taps per prompt
            add(f"golden/p{p}/prefill/L{k // 16}/tap{k % 16}", "float32", (224, 7168), 4)
    return json.dumps({"metadata": {}, "tensors": entries}, sort_keys=True, separators=(",", ":")).encode()


def hostile() -> None:
    cases = {
        "64 MiB of [] (items over the limit)": b"[" + b",".join([b"[]"] * ((MAX_HEADER_BYTES - 2) // 3)) + b"]",
        # 8 items around the list; each {} is 2 (itself and a comma), each string 1 (a comma)
        "2^22 items of {} (at the limit)": b'{"metadata":{"x":[' + b",".join([b"{}"] * ((MAX_JSON_ITEMS - 7) // 2))
                                           + b']},"tensors":[]}',
        "2^22 items of short strings": b'{"metadata":{"x":[' + b",".join([b'"ab"'] * (MAX_JSON_ITEMS - 7))
                                       + b']},"tensors":[]}',
        "one 64 MiB string": b'{"metadata":{"x":"' + b"y" * (MAX_HEADER_BYTES - 40) + b'"},"tensors":[]}',
        "1,000,000 levels deep": b"[" * 1_000_000 + b"]" * 1_000_000,
        "full K2.6 bundle directory (valid JSON; layout refused)": _k26_directory(),
    }
    with tempfile.TemporaryDirectory() as d:
        for label, header in cases.items():
            path = Path(d) / "h.kdtr"
            _file(path, header)
            del header
            tracemalloc.start()
            t0 = time.perf_counter()
            try:
                open_kdtr(path).close()
                outcome = "opened"
            except KdtrError as e:
                outcome = type(e).__name__
            dt = time.perf_counter() - t0
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            print(f"{label}: {path.stat().st_size / 2**20:.1f} MiB file -> {outcome} in {dt:.2f} s, "
                  f"peak {peak / 2**20:.0f} MiB", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", help="save files that raised something other than KdtrError here")
    ap.add_argument("--hostile", action="store_true", help="hostile headers at the limits instead")
    args = ap.parse_args()
    if args.hostile:
        hostile()
    else:
        sys.exit(fuzz(args.cases, args.seed, args.keep))


if __name__ == "__main__":
    main()
