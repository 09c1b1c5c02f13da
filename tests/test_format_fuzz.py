"""Fuzz the reader: byte flips, truncations, extensions, and re-sealed header edits (the digest fixed
up, so the parser itself is exercised). Every outcome must be a clean open or a KdtrError subclass;
views stay inside the file, memory stays bounded by the file size, and nothing hangs."""
import hashlib
import json
import random
import struct
import time
import tracemalloc

import numpy as np
import pytest

from kdtr_format import KdtrError, Tensor, open_kdtr, write_kdtr

SEED = 20260501
SLOW_CASE_S = 5.0          # a hang detector, not a speed test: cases take ~1 ms, but a loaded CI VM stalls
ALLOC_SLACK = 256 << 10    # Python objects of a parsed header; a size-field-driven allocation is far larger


def base_files(tmp_path):
    """A few valid files covering every dtype, INT4, 0-d, empty tensors and nested metadata."""
    rng = np.random.default_rng(0)
    files = []
    contents = [
        {"w": rng.standard_normal((3, 5)).astype(np.float32), "b": np.array(True)},
        {"qw": Tensor(rng.integers(-2**31, 2**31, (4, 2), dtype=np.int32), int4_shape=(4, 16)),
         "sc": Tensor(np.full((4, 1), 0x3F80, np.uint16), dtype="bfloat16"),
         "e": np.zeros((0, 7), np.int8), "h": np.arange(5, dtype=np.float16)},
        {f"t{i}": np.arange(i + 1, dtype=dt) for i, dt in enumerate(
            [np.float64, np.int64, np.int32, np.int16, np.uint8, np.int8])},
    ]
    for i, tensors in enumerate(contents):
        path = tmp_path / f"base{i}.kdtr"
        write_kdtr(path, tensors, {"cfg": {"hidden_size": 8, "layers": [1, [2, {"x": None}]]}, "i": i})
        files.append(path.read_bytes())
    return files


def reseal(data: bytes, header: bytes) -> bytes:
    """Replace the header, fixing header_len and the digest so that only the parser can object."""
    hoff = struct.unpack_from("<Q", data, 16)[0]
    fields = data[:24] + struct.pack("<Q", len(header))
    return fields + hashlib.sha256(fields + header).digest() + data[64:hoff] + header


def header_of(data: bytes) -> dict:
    hoff = struct.unpack_from("<Q", data, 16)[0]
    return json.loads(data[hoff:])


EVIL = [0, -1, 1, 63, 64, 65, 2**31, 2**32 - 1, 2**53, 2**63 - 1, 2**63, 2**64, 2**100, -2**63, 1.5,
        "1", "", None, True, [], [2**62, 2**62], [0] * 9, {}, "x" * 300, "float32", "bool"]


def mutate_structure(rng: random.Random, data: bytes) -> bytes:
    """Set one directory or metadata field to an adversarial value, then re-seal."""
    doc = header_of(data)
    target = rng.choice(doc["tensors"] + [doc]) if doc["tensors"] else doc
    key = rng.choice(sorted(target) + ["int4_shape", "extra"])
    target[key] = rng.choice(EVIL + [rng.choice(doc["tensors"])["offset"] if doc["tensors"] else 64])
    return reseal(data, json.dumps(doc).encode())


RESEALED = 3  # mutation kinds >= this fix up the digest


def mutate(rng: random.Random, data: bytes, kind: int) -> bytes:
    if kind == 0:                                   # flip 1..4 random bits anywhere
        out = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
        return bytes(out)
    if kind == 1:                                   # truncate
        return data[:rng.randrange(len(data))]
    if kind == 2:                                   # extend
        return data + bytes(rng.randrange(256) for _ in range(rng.randint(1, 100)))
    hoff = struct.unpack_from("<Q", data, 16)[0]
    header = bytearray(data[hoff:])
    if kind == 3:                                   # re-sealed random byte edits of the JSON
        for _ in range(rng.randint(1, 3)):
            header[rng.randrange(len(header))] = rng.randrange(256)
        return reseal(data, bytes(header))
    if kind == 4:                                   # re-sealed header cut short or spliced
        cut = rng.randrange(len(header))
        return reseal(data, bytes(header[:cut] + header[cut + rng.randint(1, 20):]))
    return mutate_structure(rng, data)


def read_everything(path, size: int) -> None:
    """What a user would do; any defect must surface as KdtrError."""
    with open_kdtr(path) as f:
        for name in f:
            info = f.info(name)
            assert 64 <= info.offset and info.offset + info.nbytes <= size  # never outside the file
            view = f[name]
            assert view.nbytes == info.nbytes
            f.get(name)
        f.verify()


@pytest.mark.parametrize("chunk", range(3))
def test_fuzz_reader(tmp_path, chunk):
    rng = random.Random(SEED + chunk)
    bases = base_files(tmp_path)
    outcomes = {"ok": 0, "error": 0}
    kinds: dict[str, int] = {}
    tracemalloc.start()
    try:
        for case in range(1000):
            base, kind = rng.choice(bases), rng.randrange(6)
            data = mutate(rng, base, kind)
            path = tmp_path / f"case{case}.kdtr"  # a fresh file: truncating one in place is slow on ext4
            path.write_bytes(data)
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]  # the process's own baseline grows over a run
            t0 = time.perf_counter()
            try:
                read_everything(path, len(data))
                outcomes["ok"] += 1
                # Only re-sealed edits may pass (e.g. a changed metadata value); raw damage never does.
                assert data == base or kind >= RESEALED, f"kind {kind} damage went unnoticed"
            except KdtrError as e:
                outcomes["error"] += 1
                kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + 1
                assert "\n" not in str(e), "errors must be one line"
            elapsed = time.perf_counter() - t0
            peak = tracemalloc.get_traced_memory()[1]
            detail = f"case {chunk}/{case}: {len(data)} bytes"
            assert elapsed < SLOW_CASE_S, f"{detail} took {elapsed:.2f} s"
            assert peak - before < 16 * len(data) + ALLOC_SLACK, f"{detail} allocated {peak - before} bytes"
    finally:
        tracemalloc.stop()
    assert outcomes["error"] > 500 and len(kinds) >= 8, (outcomes, kinds)


def test_every_single_byte_change_is_detected(tmp_path):
    """Any one changed byte anywhere (preamble, data, padding, header) is caught by open + verify."""
    data = base_files(tmp_path)[1]
    for offset in range(len(data)):
        path = tmp_path / f"one{offset}.kdtr"
        bad = bytearray(data)
        bad[offset] ^= 0xFF
        path.write_bytes(bytes(bad))
        with pytest.raises(KdtrError):
            read_everything(path, len(bad))
