"""Fuzz the reader: byte flips, truncations, extensions, and re-sealed structural edits of the header
JSON (tests/format_mutations.py: types, shapes, offsets, dtypes, names, nesting, sizes, INT4 pairs,
with the digest, and sometimes the layout and tensor checksums, fixed up so the parser's semantic
checks are reached). Every outcome must be a clean open or a KdtrError subclass; views stay inside
the file, memory stays bounded by the file size, and nothing hangs. bench/fuzz_format.py runs the
same cases by the hundred thousand."""
import random
import time
import tracemalloc

import pytest
from format_mutations import RESEALED, base_files, mutate

from kdtr_format import KdtrError, open_kdtr
from kdtr_format.checks import scan_json

SEED = 20260501
SLOW_CASE_S = 5.0          # a hang detector, not a speed test: cases take ~1 ms, but a loaded CI VM stalls
ALLOC_SLACK = 1 << 20      # fixed costs of one open, the JSON pre-scan's chunk (~1 MB at most) included
PER_ITEM = 128             # bytes per JSON item ([ { , :) the parser may build: a Python object and its slot


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


def run_case(path, data: bytes, kind: int, base: bytes) -> str:
    """Open a mutated file; return "ok" or the KdtrError class name. Anything else propagates."""
    path.write_bytes(data)
    try:
        read_everything(path, len(data))
    except KdtrError as e:
        assert "\n" not in str(e), "errors must be one line"
        return type(e).__name__
    # Only re-sealed edits may pass (e.g. a changed metadata value); raw damage never does.
    assert data == base or kind >= RESEALED, f"kind {kind} damage went unnoticed"
    return "ok"


@pytest.mark.parametrize("chunk", range(3))
def test_fuzz_reader(tmp_path, chunk):
    rng = random.Random(SEED + chunk)
    bases = base_files(tmp_path)
    outcomes: dict[str, int] = {}
    tracemalloc.start()
    try:
        for case in range(1000):
            base = rng.choice(bases)
            kind, data = mutate(rng, base)
            path = tmp_path / f"case{case}.kdtr"  # a fresh file: truncating one in place is slow on ext4
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]  # the process's own baseline grows over a run
            t0 = time.perf_counter()
            outcome = run_case(path, data, kind, base)
            elapsed = time.perf_counter() - t0
            peak = tracemalloc.get_traced_memory()[1]
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            detail = f"case {chunk}/{case} (kind {kind}): {len(data)} bytes"
            assert elapsed < SLOW_CASE_S, f"{detail} took {elapsed:.2f} s"
            budget = 16 * len(data) + PER_ITEM * scan_json(data)[1] + ALLOC_SLACK  # the documented bound
            assert peak - before < budget, f"{detail} allocated {peak - before} bytes"
    finally:
        tracemalloc.stop()
    errors = sum(n for k, n in outcomes.items() if k != "ok")
    # The structural edits must reach the semantic checks, not only the digest and the JSON parser.
    semantic = {"InvalidShapeError", "ShapeMismatchError", "Int4LayoutError", "InvalidNameError",
                "DuplicateNameError", "InvalidDtypeError", "OffsetError", "MetadataError"}
    assert errors > 500 and len(semantic & outcomes.keys()) >= 7, outcomes


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
