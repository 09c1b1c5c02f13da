"""Open-time benchmark: how long open_kdtr takes on a ~2 GB file with many tensors, and how much
resident memory it adds (target: < 50 ms, < 50 MB). Not a test: run it by hand,

    python bench/bench_open.py [--gb 2] [--tensors 4096] [--dir /tmp]

It writes the file in a temp dir (streamed, so the writer itself stays at one tensor of memory),
drops it from the page cache where the OS allows, times a cold and several warm opens, measures RSS
before/after opening (and after verify, for contrast), and deletes the file.
"""
import argparse
import os
import resource
import shutil
import tempfile
import time

import numpy as np

from kdtr_format import open_kdtr, write_kdtr


def rss_mb() -> float:
    """Current resident set size in MB (Linux /proc; falls back to the peak from getrusage)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def tensors(total_bytes: int, count: int):
    """count float32 tensors of ~total_bytes/count each; one buffer reused, so memory stays small."""
    per = total_bytes // count // 4
    rows = 128
    block = np.random.default_rng(0).standard_normal((rows, per // rows)).astype(np.float32)
    for i in range(count):
        block[0, 0] = i  # distinct content per tensor
        yield f"model.layers.{i // 32}.mlp.experts.{i % 32}.weight", block


def drop_cache(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        return True
    except (AttributeError, OSError):
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--tensors", type=int, default=4096)
    ap.add_argument("--dir", default=None, help="where to put the temp file (default: system temp)")
    args = ap.parse_args()
    total = int(args.gb * (1 << 30))
    workdir = tempfile.mkdtemp(prefix="kdtr-bench-", dir=args.dir)
    free = shutil.disk_usage(workdir).free
    if free < 2 * total:
        raise SystemExit(f"need {2 * total >> 20} MB free in {workdir}, have {free >> 20} MB")
    path = os.path.join(workdir, "bench.kdtr")
    try:
        t0 = time.perf_counter()
        write_kdtr(path, tensors(total, args.tensors), {"bench": "open", "tensors": args.tensors})
        t_write = time.perf_counter() - t0
        size = os.path.getsize(path)
        cold = drop_cache(path)

        rss0 = rss_mb()
        t0 = time.perf_counter()
        f = open_kdtr(path)
        t_open_cold = time.perf_counter() - t0
        rss_open = rss_mb() - rss0
        n = len(f)
        f.close()
        warm = []
        for _ in range(10):
            t0 = time.perf_counter()
            with open_kdtr(path):
                pass
            warm.append(time.perf_counter() - t0)
        with open_kdtr(path) as f:
            t0 = time.perf_counter()
            f.verify()
            t_verify = time.perf_counter() - t0
            rss_verify = rss_mb() - rss0
        print(f"file: {size / 1e9:.2f} GB, {n} tensors, header {f.header_len / 1024:.0f} KiB "
              f"(written in {t_write:.1f} s, {size / t_write / 1e9:.2f} GB/s)")
        print(f"open (cold{'' if cold else ' -- page cache not dropped'}): {t_open_cold * 1e3:.1f} ms, "
              f"RSS +{rss_open:.1f} MB   [target < 50 ms, < 50 MB]")
        print(f"open (warm, best of 10): {min(warm) * 1e3:.1f} ms")
        print(f"verify all: {t_verify:.2f} s ({size / t_verify / 1e9:.2f} GB/s SHA-256), "
              f"RSS +{rss_verify:.0f} MB (file pages, reclaimable)")
    finally:
        shutil.rmtree(workdir)


if __name__ == "__main__":
    main()
