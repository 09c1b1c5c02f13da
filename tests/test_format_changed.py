"""A .kdtr file that changes under its reader, and hashing that stays bounded.

A file truncated while mapped used to kill the reader with SIGBUS; now every read checks the file is as
it was opened (size, mtime), a private open reads with pread (a short read is an error, never a signal),
and hashing reads one chunk at a time into one buffer, so a huge declared tensor costs time, shown as
progress, and never memory."""
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from kdtr_format import ChecksumError, FileChangedError, TruncatedFileError, open_kdtr, write_kdtr
from kdtr_format.extents import CHUNK
from format_sparse import with_sparse_tensor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def two_tensors(tmp_path):
    path = tmp_path / "t.kdtr"
    write_kdtr(path, {"a": np.arange(4096, dtype=np.float32), "b": np.ones(4096, np.float32)}, {})
    return path


@pytest.mark.parametrize("private", [False, True])
def test_a_file_truncated_while_open_is_a_truncated_file_error(two_tensors, private):
    with open_kdtr(two_tensors, private=private) as f:
        assert float(f["a"][3]) == 3.0
        os.truncate(two_tensors, 4096)                     # cut through tensor a, the header gone
        with pytest.raises(TruncatedFileError, match=r"truncated while being read \(4096 bytes now, \d+ when"):
            f["b"]
        with pytest.raises(TruncatedFileError, match="truncated while being read"):
            f.verify()


def test_a_file_rewritten_in_place_while_open_is_a_changed_file_error(two_tensors):
    with open_kdtr(two_tensors, private=True) as f:
        time.sleep(0.01)                                   # a visibly later mtime
        with open(two_tensors, "r+b") as fh:
            fh.seek(100)
            fh.write(b"\x7f")
        with pytest.raises(FileChangedError, match="changed while being read"):
            f["a"]


def test_a_private_read_is_a_checked_copy(two_tensors, tmp_path):
    """private=True hands out bytes that match their checksum, and never a view of the file."""
    with open_kdtr(two_tensors, private=True) as f:
        a = f["a"]
        assert not a.flags.writeable and a.base is not None and np.array_equal(a, np.arange(4096))
    bad = tmp_path / "bad.kdtr"
    data = bytearray(two_tensors.read_bytes())
    data[64 + 8] ^= 1                                       # a bit of tensor a
    bad.write_bytes(bytes(data))
    with open_kdtr(bad, private=True) as f:
        assert np.array_equal(f["b"], np.ones(4096))
        with pytest.raises(ChecksumError, match="tensor 'a': checksum mismatch"):
            f["a"]


def test_verify_reports_progress_in_bytes(two_tensors):
    seen = []
    with open_kdtr(two_tensors) as f:
        f.verify(progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (2 * 4096 * 4, 2 * 4096 * 4) and [d for d, _ in seen] == sorted(d for d, _ in seen)


HASH_BIG = """
import resource, sys, time
from kdtr_format import ChecksumError, open_kdtr
t0, ticks = time.monotonic(), []
with open_kdtr(sys.argv[1]) as f:
    try:
        f.verify(names=["big"], progress=lambda done, total: ticks.append(done))
    except ChecksumError as e:
        print("mismatch" if "'big': checksum mismatch" in str(e) else e)
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))   # KiB, this image
print(f"{time.monotonic() - t0:.2f} s {len(ticks)} ticks {hwm}")
"""


def test_hashing_a_huge_sparse_tensor_keeps_memory_at_one_chunk(two_tensors, tmp_path):
    """2 GiB declared (a hole on disk): hashed in CHUNK-sized reads; the peak resident memory of the whole
    process stays far below the tensor (mapped, every page hashed stayed resident: 21 GB at 21 GB hashed)."""
    big = tmp_path / "big.kdtr"
    size = 2 << 30
    with_sparse_tensor(two_tensors, big, "big", size)
    proc = subprocess.Popen([sys.executable, "-c", HASH_BIG, str(big)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE, text=True)
    _, status, _ = os.wait4(proc.pid, 0)
    out = proc.stdout.read()
    # the child's own high-water mark (VmHWM of its image): wait4's ru_maxrss also counts the parent's
    # resident set at the fork (measured: 423-545 MiB when pytest had loaded torch, 57 MiB alone)
    peak = int(out.split()[5]) * 1024
    print(f"hashed {size >> 30} GiB declared: {out.split()[1]} s, peak resident memory {peak / 2**20:.0f} MiB")
    assert os.waitstatus_to_exitcode(status) == 0 and out.startswith("mismatch"), out
    assert int(out.split()[3]) == size // CHUNK                          # progress after every chunk
    assert peak < 16 * CHUNK + (200 << 20), f"{peak / 2**20:.0f} MiB resident while hashing 2 GiB"
