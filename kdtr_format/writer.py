"""Write a .kdtr file: streaming, deterministic, atomic.

Streaming: tensors are written one at a time straight into the data section (which starts at the
fixed offset 64), so memory is bounded by the largest tensor (its little-endian contiguous copy, if
the input was not already one). The JSON header goes after the data, when every offset and checksum
is known, and the 64-byte preamble that points at it is written last: until then the file does not
even carry the magic. Deterministic: the bytes depend only on the tensors (in the given order) and
the metadata (JSON with sorted keys, no whitespace, no timestamps). Atomic: through
kdtr_format.paths.write_atomically (temp file beside the target, fsync, rename, removed on any
exception or termination signal); a target that is a device or FIFO is refused (the preamble is
written last, so the output must be seekable).
"""
import hashlib
import json
import os
from collections.abc import Iterable, Mapping

import numpy as np

from kdtr_format import spec
from kdtr_format.errors import (
    DuplicateNameError, HeaderTooLargeError, InvalidDtypeError, MetadataError)
from kdtr_format.paths import write_atomically
from kdtr_format.checks import (
    check_dtype, check_int4_pairs, check_int4_shape, check_name, check_shape, header_digest)

# numpy dtype (byte order ignored) -> kdtr dtype name; uint16 is absent: bfloat16 must be explicit.
_BY_NUMPY = {dt.newbyteorder("="): name for name, dt in spec.DTYPES.items() if name != "bfloat16"}


class Tensor:
    """A tensor to write with an explicit dtype and/or INT4 logical shape.

    dtype="bfloat16": data holds the raw bfloat16 bits as uint16.
    int4_shape=(out, in): data holds int32 packed words [out, in/8] (see docs/kdtr-format.md).
    """

    def __init__(self, data: np.ndarray, dtype: str | None = None,
                 int4_shape: tuple[int, int] | None = None):
        self.data = np.asarray(data)
        self.dtype = dtype
        self.int4_shape = tuple(int(d) for d in int4_shape) if int4_shape is not None else None

    def __repr__(self) -> str:
        return f"Tensor(shape={self.data.shape}, dtype={self.dtype!r}, int4_shape={self.int4_shape})"


def _prepare(name: str, value, where: str) -> tuple[str, np.ndarray, tuple | None]:
    """Validate one tensor; return (kdtr dtype, little-endian C-contiguous array, int4_shape)."""
    check_name(name, where)
    t = value if isinstance(value, Tensor) else Tensor(value)
    have = t.data.dtype.newbyteorder("=")  # byte order is ours to fix, not the caller's
    dtype = t.dtype
    if dtype is None:
        if have not in _BY_NUMPY:
            hint = " (for bfloat16 bits use Tensor(data, dtype='bfloat16'))" if have == np.uint16 else ""
            raise InvalidDtypeError(
                f"{where}: tensor '{name}': numpy dtype {t.data.dtype} is not a kdtr dtype{hint}; "
                f"cast to one of {', '.join(spec.DTYPES)}")
        dtype = _BY_NUMPY[have]
    check_dtype(name, dtype, where)
    if have != spec.DTYPES[dtype].newbyteorder("="):
        raise InvalidDtypeError(
            f"{where}: tensor '{name}': data has numpy dtype {t.data.dtype} but dtype={dtype!r} "
            f"needs {spec.DTYPES[dtype]}; cast the data first")
    check_shape(name, t.data.shape, where)
    if t.int4_shape is not None:
        check_int4_shape(name, dtype, t.data.shape, t.int4_shape, where)
    arr = np.asarray(t.data, dtype=spec.DTYPES[dtype])  # byte-swaps a big-endian input
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")  # (np.ascontiguousarray would turn a 0-d array into 1-d)
    return dtype, arr, t.int4_shape


def _plain_json(value, where: str, path: str = "metadata", depth: int = 1):
    """Metadata as plain JSON types (tuples -> lists, numpy scalars -> Python), checking keys and depth."""
    if depth > spec.MAX_JSON_DEPTH - 1:  # the header object adds one level around the metadata
        raise MetadataError(f"{where}: {path} nests deeper than {spec.MAX_JSON_DEPTH - 1} levels; "
                            f"flatten the metadata")
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, dict):
        for k in value:
            if not isinstance(k, str):
                raise MetadataError(f"{where}: {path} has key {k!r} of type {type(k).__name__}; "
                                    f"metadata keys must be strings")
        return {k: _plain_json(v, where, f"{path}.{k}", depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_json(v, where, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise MetadataError(f"{where}: {path} = {value}; JSON has no NaN/Infinity, store it as a "
                                f"string")
        return value
    raise MetadataError(f"{where}: {path} has type {type(value).__name__}, which is not JSON; "
                        f"convert it to str, number, bool, None, list or dict")


def _items(tensors) -> Iterable:
    return tensors.items() if isinstance(tensors, Mapping) else tensors


def write_kdtr(path, tensors, metadata: dict) -> None:
    """Write tensors (a mapping, or an iterable of (name, ndarray | Tensor) pairs, consumed once in
    order) and a JSON-able metadata dict to path, atomically."""
    path = os.fspath(path)
    if not isinstance(metadata, dict):
        raise MetadataError(f"{path}: metadata is a {type(metadata).__name__}; pass a dict")
    plain_meta = _plain_json(metadata, path)

    def write(fh) -> None:
        fh.write(bytes(spec.PREAMBLE_SIZE))  # placeholder: the preamble is written last
        entries = _write_data(fh, tensors, path)
        check_int4_pairs({e["name"]: (e["dtype"], e["shape"], e.get("int4_shape")) for e in entries}, path)
        header = _header_bytes(plain_meta, entries, path)
        header_offset = fh.tell()
        fh.write(header)
        fh.seek(0)
        fields = spec.PREAMBLE.pack(spec.MAGIC, spec.VERSION_MAJOR, spec.VERSION_MINOR,
                                    spec.BYTE_ORDER_MARK, header_offset, len(header), bytes(32))
        fh.write(fields[:spec.DIGESTED_PREAMBLE] + header_digest(fields, header))

    write_atomically(path, write)


def _write_data(fh, tensors, where: str) -> list[dict]:
    """Stream tensors into the data section; return their directory entries."""
    entries, seen = [], set()
    pos = spec.DATA_START
    for name, value in _items(tensors):
        dtype, arr, int4_shape = _prepare(name, value, where)
        if name in seen:
            raise DuplicateNameError(f"{where}: tensor name '{name}' is given twice; names must be "
                                     f"unique")
        seen.add(name)
        raw = arr.reshape(-1).view(np.uint8)  # a view: arr is C-contiguous
        entry = {"name": name, "dtype": dtype, "shape": list(arr.shape), "offset": pos,
                 "nbytes": raw.nbytes, "sha256": hashlib.sha256(raw).hexdigest()}
        if int4_shape is not None:
            entry["int4_shape"] = list(int4_shape)
        fh.write(raw)
        end = pos + raw.nbytes
        pos = spec.align_up(end)
        fh.write(bytes(pos - end))
        entries.append(entry)
        del arr, raw, value  # keep at most one tensor alive
    return entries


def _header_bytes(metadata: dict, entries: list[dict], where: str) -> bytes:
    header = json.dumps({"metadata": metadata, "tensors": entries}, sort_keys=True,
                        separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")
    if len(header) > spec.MAX_HEADER_BYTES:
        raise HeaderTooLargeError(
            f"{where}: header would be {len(header)} bytes, over the limit of "
            f"{spec.MAX_HEADER_BYTES}; shrink the metadata or split the tensors over several files")
    return header
