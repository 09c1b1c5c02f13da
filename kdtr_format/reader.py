"""Open a .kdtr file: validate the preamble and header, then hand out zero-copy read-only tensor views.

Opening refuses anything but a regular file (a FIFO would block), then reads 64 bytes of preamble
and the JSON header, nothing else; the data section is mmapped and
touched only when a tensor is read or verified. Validation runs in the order of docs/kdtr-format.md
(magic, version, byte order, header size, file extent, header checksum, JSON depth and size
scanned before parsing, JSON, directory extents, dtype x shape, names, INT4 pairs); all arithmetic is on Python ints, so no size can overflow, and no buffer is
allocated from a size field before that size was checked against the file length.
"""
import gc
import hashlib
import json
import mmap
import os
import re
from typing import Iterator, NamedTuple

import numpy as np

from kdtr_format import spec
from kdtr_format.bf16 import bf16_to_float32
from kdtr_format.checks import (
    check_dtype, check_int4_pairs, check_int4_shape, check_name, check_shape, check_zero_size_extent,
    header_digest, scan_json)
from kdtr_format.errors import (
    REGENERATE, AlignmentError, ByteOrderError, ChecksumError, ClosedFileError, DuplicateNameError,
    HeaderChecksumError, HeaderFormatError, HeaderTooLargeError, InvalidBoolError, MetadataError,
    NotAKdtrFileError, OffsetError, OverlapError, PaddingError,
    ShapeMismatchError, TensorNotFoundError, TrailingDataError, TruncatedFileError,
    UnsupportedVersionError)
from kdtr_format.paths import open_regular

TOP_KEYS = {"metadata", "tensors"}
ENTRY_KEYS = {"name", "dtype", "shape", "offset", "nbytes", "sha256"}
OPTIONAL_ENTRY_KEYS = {"int4_shape"}
_ENTRY_KEYS_INT4 = ENTRY_KEYS | OPTIONAL_ENTRY_KEYS
_HEX64 = re.compile(r"[0-9a-f]{64}")


class TensorInfo(NamedTuple):  # a NamedTuple, not a frozen dataclass: 5x cheaper to build per open
    """One directory entry. offset is the absolute byte offset in the file; checksum is SHA-256 hex."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    checksum: str
    int4_shape: tuple[int, int] | None = None


def _object_pairs(pairs: list) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise HeaderFormatError(f"duplicate JSON key {dup!r}")
    return obj


def _reject_constant(token: str):
    raise HeaderFormatError(f"non-standard JSON constant {token}")


# ---- the reader ------------------------------------------------------------------------------------

class KdtrFile:
    """An open .kdtr file. Use as a context manager; see open_kdtr."""

    def __init__(self, path, verify: bool = False):
        self.path = os.fspath(path)
        self._mm = None
        self._closed = False
        with open_regular(self.path, "kdtr file") as fh:
            self.file_size = os.fstat(fh.fileno()).st_size
            self._read_header(fh)
            self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        if verify:
            try:
                self.verify()
            except BaseException:
                self.close()
                raise

    # -- header parsing, in spec order --

    def _read_header(self, fh) -> None:
        p, size = self.path, self.file_size
        pre = fh.read(spec.PREAMBLE_SIZE)
        if len(pre) < len(spec.MAGIC) or pre[:len(spec.MAGIC)] != spec.MAGIC:
            raise NotAKdtrFileError(
                f"{p}: not a kdtr file (first bytes {pre[:8].hex(' ') or 'none'}, expected magic "
                f"{spec.MAGIC.hex(' ')}); pass a .kdtr file, or convert safetensors with `kdtr convert`")
        if len(pre) < spec.PREAMBLE_SIZE:
            raise TruncatedFileError(
                f"{p}: truncated: {size} bytes, shorter than the {spec.PREAMBLE_SIZE}-byte preamble; "
                f"{REGENERATE}")
        _, major, minor, bom, hoff, hlen, digest = spec.PREAMBLE.unpack(pre)
        if major != spec.VERSION_MAJOR:
            raise UnsupportedVersionError(
                f"{p}: format version {major}.{minor} is not supported (this reader implements "
                f"{spec.VERSION_MAJOR}.x); upgrade kdtr or {REGENERATE}")
        if bom != spec.BYTE_ORDER_MARK:
            raise ByteOrderError(
                f"{p}: byte-order mark 0x{bom:08X} != 0x{spec.BYTE_ORDER_MARK:08X}; kdtr files are "
                f"little-endian; {REGENERATE}")
        if not 0 < hlen <= spec.MAX_HEADER_BYTES:
            raise HeaderTooLargeError(
                f"{p}: header_len {hlen} is outside 1..{spec.MAX_HEADER_BYTES}; {REGENERATE}")
        if hoff < spec.DATA_START:
            raise OffsetError(
                f"{p}: header_offset {hoff} lies inside the {spec.PREAMBLE_SIZE}-byte preamble; "
                f"{REGENERATE}")
        if hoff % spec.ALIGNMENT:
            raise AlignmentError(
                f"{p}: header_offset {hoff} is not a multiple of {spec.ALIGNMENT}; {REGENERATE}")
        if hoff + hlen > size:
            raise TruncatedFileError(
                f"{p}: truncated: header ends at byte {hoff + hlen} but the file has {size} bytes; "
                f"{REGENERATE}")
        if hoff + hlen < size:
            raise TrailingDataError(
                f"{p}: {size - hoff - hlen} bytes follow the header (file must end at byte "
                f"{hoff + hlen}); {REGENERATE}")
        fh.seek(hoff)
        raw = fh.read(hlen)  # hlen <= file size, checked just above
        got = header_digest(pre, raw)
        if got != digest:
            raise HeaderChecksumError(
                f"{p}: header checksum mismatch (SHA-256 {got.hex()[:16]}... != preamble "
                f"{digest.hex()[:16]}...): the preamble or header is corrupt; {REGENERATE}")
        self.version = (major, minor)
        self.header_offset, self.header_len, self.header_sha256 = hoff, hlen, digest.hex()
        # Parsing builds ~10 objects per tensor and no cycles; pausing the cyclic GC halves open time
        # for thousands of tensors (bench/bench_open.py).
        text = self._scan_and_decode(raw)
        del raw   # the header is held once, as text, while it is parsed (a 64 MiB string costs 128)
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            self._parse_header(text, minor)
        finally:
            if gc_was_enabled:
                gc.enable()

    def _scan_and_decode(self, raw: bytes) -> str:
        """Depth and item limits, checked in one pass over the bytes before any parsing; then UTF-8."""
        p = self.path
        depth, items = scan_json(raw)  # before parsing: bounds the parser's time, memory and recursion
        if depth > spec.MAX_JSON_DEPTH:
            raise MetadataError(
                f"{p}: header JSON nests {depth} deep, over the limit of {spec.MAX_JSON_DEPTH}; "
                f"flatten the metadata and {REGENERATE}")
        if items > spec.MAX_JSON_ITEMS:
            raise HeaderTooLargeError(
                f"{p}: header JSON has {items} structural characters ([ {{ , :), over the limit of "
                f"{spec.MAX_JSON_ITEMS}; split the tensors over several files and {REGENERATE}")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise HeaderFormatError(f"{p}: header is not UTF-8 ({e.reason} at byte {e.start}); "
                                    f"{REGENERATE}") from None

    def _parse_header(self, text: str, minor: int) -> None:
        p = self.path
        try:
            doc = json.loads(text, object_pairs_hook=_object_pairs, parse_constant=_reject_constant)
        except HeaderFormatError as e:
            raise HeaderFormatError(f"{p}: header JSON: {e}; {REGENERATE}") from None
        except ValueError as e:
            raise HeaderFormatError(f"{p}: header is not valid JSON ({e}); {REGENERATE}") from None
        except RecursionError:  # unreachable while scan_json bounds the depth; kept as a guard
            raise HeaderFormatError(f"{p}: header JSON nests too deep to parse; {REGENERATE}") from None
        strict = minor <= spec.VERSION_MINOR  # newer minors may add optional keys: ignore those
        if not isinstance(doc, dict) or not TOP_KEYS <= doc.keys() or (strict and doc.keys() - TOP_KEYS):
            got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
            raise HeaderFormatError(
                f"{p}: header must be a JSON object with keys {sorted(TOP_KEYS)}, got {got}; {REGENERATE}")
        if not isinstance(doc["metadata"], dict):
            raise MetadataError(
                f"{p}: field 'metadata' is a {type(doc['metadata']).__name__}, not a JSON object; "
                f"{REGENERATE}")
        if not isinstance(doc["tensors"], list):
            raise HeaderFormatError(
                f"{p}: field 'tensors' is a {type(doc['tensors']).__name__}, not a JSON list; "
                f"{REGENERATE}")
        self.metadata = doc["metadata"]
        entries = [self._entry(i, e, strict) for i, e in enumerate(doc["tensors"])]
        self._check_extents(entries)
        for info in entries:
            if type(info.dtype) is not str or info.dtype not in spec.DTYPES:
                check_dtype(info.name, info.dtype, p)
            if len(info.shape) > spec.MAX_NDIM or any(type(d) is not int or d < 0 or d > spec.MAX_INT
                                                      for d in info.shape):
                check_shape(info.name, info.shape, p)
            if spec.DTYPES[info.dtype].itemsize * _product(info.shape) != info.nbytes:
                raise ShapeMismatchError(
                    f"{p}: tensor '{info.name}': nbytes {info.nbytes} != {info.dtype} size "
                    f"{spec.DTYPES[info.dtype].itemsize} x shape {list(info.shape)}; {REGENERATE}")
            if info.nbytes == 0:
                check_zero_size_extent(info.name, info.dtype, info.shape, p)
            if info.int4_shape is not None:
                check_int4_shape(info.name, info.dtype, info.shape, info.int4_shape, p)
        self._infos: dict[str, TensorInfo] = {}
        for info in entries:
            if info.name in self._infos:
                raise DuplicateNameError(f"{p}: tensor name '{info.name}' appears twice; {REGENERATE}")
            self._infos[info.name] = info
        check_int4_pairs({n: (i.dtype, i.shape, i.int4_shape) for n, i in self._infos.items()
                          if i.int4_shape is not None or n.endswith((".qw", ".sc"))}, p)

    def _entry(self, i: int, e, strict: bool) -> TensorInfo:
        """Type-check one directory entry (values are checked later, in spec order). Written for
        speed: this runs once per tensor on every open."""
        p = self.path
        keys = e.keys() if type(e) is dict else None
        if keys is None or not (keys == ENTRY_KEYS or keys == _ENTRY_KEYS_INT4
                                or (not strict and keys >= ENTRY_KEYS)):
            got = sorted(e) if isinstance(e, dict) else type(e).__name__
            raise HeaderFormatError(
                f"{p}: tensors[{i}] must be an object with keys {sorted(ENTRY_KEYS)} "
                f"(+ optional int4_shape), got {got}; {REGENERATE}")
        offset, nbytes, shape, sha = e["offset"], e["nbytes"], e["shape"], e["sha256"]
        int4 = e.get("int4_shape")  # absent, or a list: `null` is not "absent"
        if not (type(offset) is int and type(nbytes) is int and 0 <= offset <= spec.MAX_INT
                and 0 <= nbytes <= spec.MAX_INT and type(shape) is list and type(sha) is str
                and _HEX64.fullmatch(sha) and (type(int4) is list or "int4_shape" not in keys)):
            self._entry_error(i, e)
        name = e["name"]  # checked here, so that every later message can quote it on one line
        if type(name) is not str or not 0 < len(name) <= spec.MAX_NAME_BYTES \
                or not name.isascii() or not name.isprintable():
            check_name(name, p)
        return TensorInfo(name, e["dtype"], tuple(shape), offset, nbytes, sha,
                          tuple(int4) if int4 is not None else None)

    def _entry_error(self, i: int, e: dict) -> None:
        """Raise the error for the first ill-typed field of entry i (the slow path of _entry)."""
        p = self.path
        label = f"tensors[{i}] ({e['name']!r})" if isinstance(e["name"], str) else f"tensors[{i}]"
        for key in ("offset", "nbytes"):
            if type(e[key]) is not int or not 0 <= e[key] <= spec.MAX_INT:
                raise HeaderFormatError(f"{p}: {label}: field '{key}' = {e[key]!r} is not an integer "
                                        f"in [0, 2^63); {REGENERATE}")
        if type(e["shape"]) is not list:
            raise HeaderFormatError(f"{p}: {label}: field 'shape' = {e['shape']!r} is not a list; "
                                    f"{REGENERATE}")
        if type(e["sha256"]) is not str or not _HEX64.fullmatch(e["sha256"]):
            raise HeaderFormatError(f"{p}: {label}: field 'sha256' = {e['sha256']!r} is not 64 "
                                    f"lowercase hex digits; {REGENERATE}")
        raise HeaderFormatError(f"{p}: {label}: field 'int4_shape' = {e['int4_shape']!r} is not a "
                                f"list (omit the key for a tensor that is not packed INT4); {REGENERATE}")

    def _check_extents(self, entries: list[TensorInfo]) -> None:
        """Extents in directory order: inside the data section, non-overlapping, aligned, no gaps."""
        p, end = self.path, spec.DATA_START
        for info in entries:
            name = info.name
            if info.offset < spec.DATA_START or info.offset + info.nbytes > self.header_offset:
                raise OffsetError(
                    f"{p}: tensor '{name}': extent [{info.offset}, {info.offset + info.nbytes}) lies "
                    f"outside the data section [{spec.DATA_START}, {self.header_offset}); {REGENERATE}")
            if info.offset < end:
                raise OverlapError(
                    f"{p}: tensor '{name}': offset {info.offset} is before the end {end} of the "
                    f"previous tensor (extents must be sorted and disjoint); {REGENERATE}")
            if info.offset % spec.ALIGNMENT:
                raise AlignmentError(
                    f"{p}: tensor '{name}': offset {info.offset} is not a multiple of "
                    f"{spec.ALIGNMENT}; {REGENERATE}")
            if info.offset != spec.align_up(end):
                raise OffsetError(
                    f"{p}: tensor '{name}': offset {info.offset} leaves a gap after byte {end} "
                    f"(expected {spec.align_up(end)}); {REGENERATE}")
            end = info.offset + info.nbytes
        if spec.align_up(end) != self.header_offset:
            raise OffsetError(
                f"{p}: data ends at byte {end} but header_offset is {self.header_offset} "
                f"(expected {spec.align_up(end)}); {REGENERATE}")

    # -- public API --

    @property
    def names(self) -> list[str]:
        return list(self._infos)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise TensorNotFoundError(f"{self.path}: no tensor named {name!r} "
                                      f"({len(self._infos)} tensors; see `kdtr inspect`)") from None

    def __contains__(self, name) -> bool:
        return name in self._infos

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._infos))

    def __len__(self) -> int:
        return len(self._infos)

    def __getitem__(self, name: str) -> np.ndarray:
        """Read-only zero-copy view of the tensor (bfloat16 as raw uint16, INT4 as packed int32)."""
        info = self.info(name)
        dtype = spec.DTYPES[info.dtype]
        mm = self._mapping()
        if info.nbytes == 0:
            out = np.empty(info.shape, dtype)
            out.flags.writeable = False
            return out
        if info.dtype == "bool":
            self._check_bool(info, mm)
        return np.frombuffer(mm, dtype, count=info.nbytes // dtype.itemsize,
                             offset=info.offset).reshape(info.shape)

    def _check_bool(self, info: TensorInfo, mm) -> None:
        """NumPy would hand out a byte 2 as a bool that is true yet != True: refuse it instead."""
        raw = np.frombuffer(mm, np.uint8, count=info.nbytes, offset=info.offset)
        if raw.max() > 1:
            at = int(np.argmax(raw > 1))
            raise InvalidBoolError(
                f"{self.path}: bool tensor '{info.name}' holds byte {int(raw[at])} at element {at}; "
                f"bool bytes must be 0 or 1; {REGENERATE}")

    def get(self, name: str, to_float32: bool = True) -> np.ndarray:
        """The tensor; bfloat16 converted to a new float32 array when to_float32, else a raw view."""
        info = self.info(name)
        if info.dtype == "bfloat16" and to_float32:
            return bf16_to_float32(self[name])
        return self[name]

    def verify(self, names=None) -> None:
        """Check SHA-256 of the named tensors (all by default; then every padding byte is checked too)."""
        infos = [self.info(n) for n in names] if names is not None else list(self._infos.values())
        mm = self._mapping()
        with memoryview(mm) as view:
            for info in infos:
                got = hashlib.sha256(view[info.offset:info.offset + info.nbytes]).hexdigest()
                if got != info.checksum:
                    raise ChecksumError(
                        f"{self.path}: tensor '{info.name}': checksum mismatch (SHA-256 {got[:16]}... "
                        f"!= directory {info.checksum[:16]}...): its data is corrupt; {REGENERATE}")
                if info.dtype == "bool" and info.nbytes:
                    self._check_bool(info, mm)
            if names is None:
                self._verify_padding(view)

    def _verify_padding(self, view: memoryview) -> None:
        end, after = spec.DATA_START, "the preamble"
        for info in [*self._infos.values(), None]:
            start = info.offset if info else self.header_offset
            if any(view[end:start]):
                raise PaddingError(
                    f"{self.path}: non-zero padding in bytes [{end}, {start}) after {after}; "
                    f"{REGENERATE}")
            if info:
                end, after = info.offset + info.nbytes, f"tensor '{info.name}'"

    def _mapping(self) -> mmap.mmap:
        if self._closed:
            raise ClosedFileError(f"{self.path}: file is closed; read tensors inside `with open_kdtr(...)`")
        return self._mm

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._mm.close()
        except BufferError:
            pass  # views handed out are still alive; the mapping is released with the last of them
        self._mm = None

    def __enter__(self) -> "KdtrFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KdtrFile({self.path!r}, {len(self._infos)} tensors, v{self.version[0]}.{self.version[1]})"


def _product(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def open_kdtr(path, verify: bool = False) -> KdtrFile:
    """Open and validate a .kdtr file (lazily: data is mmapped, not read). verify=True also checks
    every tensor checksum and padding byte before returning."""
    return KdtrFile(path, verify=verify)


def describe(path, check: bool = False) -> dict:
    """A JSON-able summary of a file (what `kdtr inspect` shows); check=True verifies every checksum."""
    with open_kdtr(path, verify=check) as f:
        tensors = [{"name": i.name, "dtype": i.dtype, "shape": list(i.shape), "offset": i.offset,
                    "nbytes": i.nbytes, "sha256": i.checksum,
                    "int4_shape": list(i.int4_shape) if i.int4_shape is not None else None}
                   for i in f._infos.values()]
        return {"path": f.path, "version": f"{f.version[0]}.{f.version[1]}",
                "file_size": f.file_size, "header_offset": f.header_offset,
                "header_len": f.header_len, "header_sha256": f.header_sha256,
                "data_bytes": sum(t["nbytes"] for t in tensors), "checked": check,
                "metadata": f.metadata, "tensors": tensors}
