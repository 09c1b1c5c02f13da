"""Mutations of valid .kdtr files for the reader's fuzz test (tests/test_format_fuzz.py) and its long
run (bench/fuzz_format.py): raw damage (bit flips, truncation, extension) and structural edits of
the header JSON that are re-sealed, so that the header digest (and, for some, the layout and the
tensor checksums) are fixed up and the mutation reaches the parser's semantic checks.

`mutate(rng, data)` returns (kind, new bytes). Kinds below RESEALED are raw damage: a clean open of
their output is a bug. Every outcome of opening any output must be a clean file or a KdtrError.
"""
import copy
import hashlib
import json
import random
import struct

import numpy as np

from kdtr_format import Tensor, write_kdtr

EVIL = [0, -1, 1, 63, 64, 65, 2**31, 2**32 - 1, 2**53, 2**62, 2**63 - 1, 2**63, 2**64, 2**100, -2**63,
        1.5, 64.0, 1e300, "1", "", None, True, False, [], [2**62, 2**62], [0, 2**62], [0] * 9, {},
        "x" * 300, "float32", "bool", "int32", [1, 8], [[1]], {"a": 1}]
EVIL_NAMES = ["", " ", "a" * 256, "a" * 257, "\u00e9", "\x00", "\x7f", "[/]", "[bold]x", ".qw", "x.qw",
              "x.sc", "w\n", "\ud800", "A"]
DTYPES = ["float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"]
ITEMSIZE = {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "float16": 2, "bfloat16": 2,
            "int16": 2, "int8": 1, "uint8": 1, "bool": 1}
RESEALED = 3  # kinds >= this fix up the digest


def base_files(tmp_path) -> list[bytes]:
    """Valid files covering every dtype, an INT4 pair, bool, 0-d, empty tensors, nested metadata."""
    rng = np.random.default_rng(0)
    contents = [
        {"w": rng.standard_normal((3, 5)).astype(np.float32), "b": np.array([True, False, True])},
        {"m.qw": Tensor(rng.integers(-2**31, 2**31, (4, 2), dtype=np.int32), int4_shape=(4, 16)),
         "m.sc": Tensor(np.full((4, 1), 0x3F80, np.uint16), dtype="bfloat16"),
         "e": np.zeros((0, 7), np.int8), "h": np.arange(5, dtype=np.float16), "s": np.array(True)},
        {f"t{i}": np.arange(i + 1, dtype=dt) for i, dt in enumerate(
            [np.float64, np.int64, np.int32, np.int16, np.uint8, np.int8])},
    ]
    files = []
    for i, tensors in enumerate(contents):
        path = tmp_path / f"base{i}.kdtr"
        write_kdtr(path, tensors, {"cfg": {"hidden_size": 8, "layers": [1, [2, {"x": None}]]}, "i": i})
        files.append(path.read_bytes())
    return files


# ---- taking a file apart and putting it back together --------------------------------------------

def split(data: bytes) -> tuple[dict, list[bytes]]:
    """(header document, each tensor's bytes) of a valid file."""
    hoff = struct.unpack_from("<Q", data, 16)[0]
    doc = json.loads(data[hoff:])
    return doc, [data[t["offset"]:t["offset"] + t["nbytes"]] for t in doc["tensors"]]


def reseal(data: bytes, header: bytes) -> bytes:
    """Replace the header bytes, fixing header_len and the digest (the data section is kept)."""
    hoff = struct.unpack_from("<Q", data, 16)[0]
    fields = data[:24] + struct.pack("<Q", len(header))
    return fields + hashlib.sha256(fields + header).digest() + data[64:hoff] + header


def rebuild(doc: dict, blobs: list[bytes], fix_checksums: bool) -> bytes:
    """Lay the tensors out again by the spec's rule (offsets, padding, header_offset) for the
    entries' current nbytes (blobs cut or zero-extended to fit), then seal: structural edits of
    sizes and shapes then reach the dtype x shape and pairing checks instead of stopping at extents."""
    data, pos = bytearray(), 64
    for t, blob in zip(doc["tensors"], blobs):
        n = t.get("nbytes")
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= 1 << 16:
            raise ValueError("no layout for this nbytes")   # the caller re-seals the header only
        blob = (blob + bytes(n))[:n]
        t["offset"] = pos
        if fix_checksums:
            t["sha256"] = hashlib.sha256(blob).hexdigest()
        data += blob + bytes(-n % 64)
        pos += n + (-n % 64)
    header = json.dumps(doc).encode()
    fields = struct.pack("<8sHHIQQ", b"KDTR\r\n\x1a\n", 1, 0, 0x0A0B0C0D, 64 + len(data), len(header))
    return fields + hashlib.sha256(fields + header).digest() + bytes(data) + header


# ---- the mutations -------------------------------------------------------------------------------

def _entry(rng: random.Random, doc: dict) -> dict | None:
    return rng.choice(doc["tensors"]) if doc["tensors"] else None


def m_field(rng, doc, blobs):
    """One directory, top-level or metadata field set to an adversarial value."""
    target = rng.choice(doc["tensors"] + [doc, doc["metadata"]])
    key = rng.choice(sorted(target) + ["int4_shape", "extra"])
    target[key] = copy.deepcopy(rng.choice(EVIL))


def m_dtype(rng, doc, blobs):
    """Another dtype; nbytes follows it half of the time (then the layout is redone)."""
    t = _entry(rng, doc)
    if t:
        t["dtype"] = rng.choice(DTYPES)
        if rng.random() < 0.5 and all(isinstance(d, int) for d in t["shape"]):
            t["nbytes"] = ITEMSIZE[t["dtype"]] * int(np.prod(t["shape"], dtype=object))


def m_shape(rng, doc, blobs):
    """Dims added, dropped, zeroed, scaled, made huge or non-integer; nbytes follows half the time."""
    t = _entry(rng, doc)
    if not t:
        return
    shape = list(t["shape"])
    op = rng.randrange(6)
    if op == 0:
        shape.append(rng.choice([0, 1, 2, 7]))
    elif op == 1 and shape:
        shape.pop(rng.randrange(len(shape)))
    elif op == 2:
        shape = [0, rng.choice([2**62, 2**61, 2**63 - 1, 2**40])]
    elif op == 3 and shape:
        shape[rng.randrange(len(shape))] = rng.choice([0, 1, 3, 16, -1, 2.0, True, "4", None])
    elif op == 4:
        shape = shape[::-1] + [1] * rng.randrange(8)
    else:
        shape = [rng.randrange(1, 9) for _ in range(rng.randrange(0, 4))]
    t["shape"] = shape
    if rng.random() < 0.5 and t.get("dtype") in ITEMSIZE and all(
            type(d) is int and d >= 0 for d in shape):
        t["nbytes"] = ITEMSIZE[t["dtype"]] * int(np.prod(shape, dtype=object))


def m_offset(rng, doc, blobs):
    """Offsets shifted, swapped or set to another tensor's."""
    ts = doc["tensors"]
    if not ts:
        return
    t = rng.choice(ts)
    op = rng.randrange(3)
    if op == 0:
        t["offset"] += rng.choice([-64, -1, 1, 63, 64, 128])
    elif op == 1 and len(ts) > 1:
        a, b = rng.sample(ts, 2)
        a["offset"], b["offset"] = b["offset"], a["offset"]
    else:
        t["offset"] = rng.choice(ts)["offset"]


def m_name(rng, doc, blobs):
    """Names made invalid, duplicated, escaped-but-equal, or INT4 partners renamed away."""
    t = _entry(rng, doc)
    if not t:
        return
    op = rng.randrange(3)
    if op == 0:
        t["name"] = rng.choice(EVIL_NAMES)
    elif op == 1:
        t["name"] = rng.choice(doc["tensors"])["name"]
    else:
        t["name"] = t["name"].replace(".sc", ".scale").replace(".qw", ".q") if rng.random() < 0.5 \
            else t["name"] + rng.choice([".qw", ".sc", "/x"])


def m_int4(rng, doc, blobs):
    """int4_shape null, malformed or moved; scale shapes and dtypes changed."""
    t = _entry(rng, doc)
    if not t:
        return
    op = rng.randrange(4)
    if op == 0:
        t["int4_shape"] = rng.choice([None, [], [1], [4, 16, 1], [16, 4], [4, 15], [4, 2**63], "4x16"])
    elif op == 1:
        t["int4_shape"] = [t["shape"][0] if t["shape"] else 1, 8 * (t["shape"][-1] if t["shape"] else 1)]
    elif op == 2:
        t.pop("int4_shape", None)
    else:
        t["shape"] = [rng.choice([1, 4, 5]), rng.choice([1, 2, 3])]
        t["dtype"] = rng.choice(["bfloat16", "float16", "float32", "int32", "int8"])
        t["nbytes"] = ITEMSIZE[t["dtype"]] * t["shape"][0] * t["shape"][1]


def m_entries(rng, doc, blobs):
    """Entries dropped, duplicated, reordered, given unknown keys or replaced by non-objects."""
    ts = doc["tensors"]
    op = rng.randrange(5)
    if op == 0 and ts:
        i = rng.randrange(len(ts))
        ts.pop(i)
        blobs.pop(i)
    elif op == 1 and ts:
        i = rng.randrange(len(ts))
        ts.insert(i, copy.deepcopy(ts[i]))
        blobs.insert(i, blobs[i])
    elif op == 2 and ts:
        order = list(range(len(ts)))
        rng.shuffle(order)
        ts[:] = [ts[i] for i in order]
        blobs[:] = [blobs[i] for i in order]
    elif op == 3 and ts:
        rng.choice(ts)[rng.choice(["extra", "Name", "sha256 "])] = 1
    elif ts:
        ts[rng.randrange(len(ts))] = rng.choice([None, [], "w", 5, [["name", "w"]]])


def m_nesting(rng, doc, blobs):
    """Metadata (or a tensor field) nested around the depth limit of 64."""
    depth = rng.choice([1, 30, 62, 63, 64, 65, 100])
    value = rng.choice([0, "x", None])
    for _ in range(depth):
        value = [value] if rng.random() < 0.5 else {"k": value}
    target = rng.choice([doc["metadata"]] + doc["tensors"][:1])
    target[rng.choice(["deep", "shape", "name"])] = value


def m_size(rng, doc, blobs):
    """Header made large in items: long lists and many keys (well under the byte limit)."""
    n = rng.choice([10, 1000, 20000])
    doc["metadata"]["bulk"] = rng.choice([[0] * n, [[]] * n, {f"k{i}": i for i in range(n)}, "y" * n])


def m_values(rng, doc, blobs):
    """A tensor's bytes changed (bool bytes set to 2 and the like), checksums fixed by rebuild."""
    if blobs:
        i = rng.randrange(len(blobs))
        b = bytearray(blobs[i])
        if b:
            b[rng.randrange(len(b))] = rng.choice([2, 0xFF, 0x80, 1])
        blobs[i] = bytes(b)


STRUCTURAL = [m_field, m_dtype, m_shape, m_offset, m_name, m_int4, m_entries, m_nesting, m_size, m_values]


def mutate_structure(rng: random.Random, data: bytes) -> bytes:
    """1-3 structural edits; then either only the header is re-sealed, or the layout is redone
    (offsets, padding, header_offset) with or without fixed-up tensor checksums."""
    doc, blobs = split(data)
    for _ in range(rng.randint(1, 3)):
        try:
            rng.choice(STRUCTURAL)(rng, doc, blobs)
        except (TypeError, KeyError, AttributeError, ValueError, IndexError):
            pass   # an earlier edit broke what this one edits (a list where an entry was): the file
                   # still carries that earlier edit
    how = rng.randrange(3)
    if how == 0:
        return reseal(data, json.dumps(doc).encode())
    try:
        return rebuild(doc, blobs, fix_checksums=how == 2)
    except (TypeError, KeyError, AttributeError, ValueError, IndexError):
        return reseal(data, json.dumps(doc).encode())   # entries no longer shaped like entries


def mutate(rng: random.Random, data: bytes) -> tuple[int, bytes]:
    kind = rng.randrange(7)
    if kind == 0:                                   # flip 1..4 random bits anywhere
        out = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
        return kind, bytes(out)
    if kind == 1:                                   # truncate
        return kind, data[:rng.randrange(len(data))]
    if kind == 2:                                   # extend
        return kind, data + bytes(rng.randrange(256) for _ in range(rng.randint(1, 100)))
    hoff = struct.unpack_from("<Q", data, 16)[0]
    header = bytearray(data[hoff:])
    if kind == 3:                                   # re-sealed random byte edits of the JSON
        for _ in range(rng.randint(1, 3)):
            header[rng.randrange(len(header))] = rng.randrange(256)
        return kind, reseal(data, bytes(header))
    if kind == 4:                                   # re-sealed header cut short or spliced
        cut = rng.randrange(len(header))
        return kind, reseal(data, bytes(header[:cut] + header[cut + rng.randint(1, 20):]))
    return kind, mutate_structure(rng, data)        # kinds 5, 6: structural (the most productive)
