"""The value rules of docs/kdtr-format.md that the reader and the writer share: names, dtypes,
shapes, INT4 pairs, the header digest, and the bounded pre-scan of the header JSON.

Every check is on Python ints (no overflow) and raises the KdtrError subclass of its failure mode
with a message that names the file (`where`), the tensor, the value and the fix.
"""
import hashlib

import numpy as np

from kdtr_format import spec
from kdtr_format.errors import (
    REGENERATE, AlignmentError, InvalidDtypeError, InvalidNameError, InvalidShapeError, Int4LayoutError,
    OffsetError, OverlapError, ShapeMismatchError)

INT4_SCALE_DTYPES = ("bfloat16", "float16", "float32")
_DEPTH_STEP = np.zeros(256, np.int8)  # byte -> nesting change: [ { open, ] } close
_DEPTH_STEP[[ord("["), ord("{")]], _DEPTH_STEP[[ord("]"), ord("}")]] = 1, -1
_ITEM = np.zeros(256, bool)           # structural characters counted against MAX_JSON_ITEMS
_ITEM[[ord("["), ord("{"), ord(","), ord(":")]] = True
_SCAN_CHUNK = 1 << 16                 # bytes per numpy pass: bounds the scan's temporaries to ~1 MB


def check_name(name, where: str) -> None:
    """1..256 printable ASCII characters, judged on the string after JSON unescaping."""
    if not isinstance(name, str) or not name or len(name) > spec.MAX_NAME_BYTES \
            or not name.isascii() or not name.isprintable():
        shown = repr(name) if not isinstance(name, str) or len(name) <= 80 else repr(name[:80]) + "..."
        raise InvalidNameError(
            f"{where}: tensor name {shown} is invalid; names are 1..{spec.MAX_NAME_BYTES} printable "
            f"ASCII characters (0x20..0x7E); rename the tensor")


def check_dtype(name: str, dtype, where: str) -> None:
    if not isinstance(dtype, str) or dtype not in spec.DTYPES:
        raise InvalidDtypeError(
            f"{where}: tensor '{name}': dtype {dtype!r} is not a kdtr dtype; use one of "
            f"{', '.join(spec.DTYPES)}")


def check_shape(name: str, shape, where: str) -> None:
    """ndim <= 8 and every dim an integer (JSON: no fraction, no exponent, not a bool) in [0, 2^63)."""
    if len(shape) > spec.MAX_NDIM:
        raise InvalidShapeError(
            f"{where}: tensor '{name}': {len(shape)} dims exceed the limit of {spec.MAX_NDIM}; "
            f"reshape the tensor")
    for d in shape:
        if type(d) is not int or not 0 <= d <= spec.MAX_INT:
            raise InvalidShapeError(
                f"{where}: tensor '{name}': dim {d!r} in shape {list(shape)} is not an integer in "
                f"[0, 2^63); {REGENERATE}")


def check_zero_size_extent(name: str, dtype: str, shape, where: str) -> None:
    """A zero-size tensor's other dims must still be addressable: the element size times the
    product of its non-zero dims stays below 2^63, so every C stride fits an int64 (NumPy refuses
    to build a [0, 2^62] float32 array for the same reason)."""
    extent = spec.DTYPES[dtype].itemsize
    for d in shape:
        extent *= d or 1
    if extent > spec.MAX_INT:
        raise InvalidShapeError(
            f"{where}: tensor '{name}': zero-size shape {list(shape)} has non-zero dims spanning "
            f"{extent} bytes of {dtype}, over 2^63 - 1 (its strides would overflow int64); "
            f"{REGENERATE}")


def check_int4_shape(name: str, dtype: str, shape, int4_shape, where: str) -> None:
    """int4_shape (out, in) must describe int32 words [out, in/8]."""
    ok = (dtype == "int32" and len(int4_shape) == 2 and len(shape) == 2
          and all(type(d) is int and 0 <= d <= spec.MAX_INT for d in int4_shape)
          and int4_shape[1] % spec.INT4_PER_WORD == 0
          and tuple(shape) == (int4_shape[0], int4_shape[1] // spec.INT4_PER_WORD))
    if not ok:
        raise ShapeMismatchError(
            f"{where}: tensor '{name}': int4_shape {list(int4_shape)} does not match packed {dtype} "
            f"shape {list(shape)}; packed INT4 is int32 [out, in/8] with in a multiple of 8")


def check_int4_pairs(tensors: dict, where: str) -> None:
    """INT4 pairing over a whole directory, tensors = {name: (dtype, shape, int4_shape or None)}:
    int4_shape only on a `<base>.qw`, every `.qw` carries it and has a `<base>.sc` of a float dtype
    and shape [out, in/g] for a group size g >= 1 (so `in` is a multiple of g)."""
    for name, (_, _, int4_shape) in tensors.items():
        if int4_shape is None and not name.endswith(".qw"):
            continue
        if int4_shape is None or not name.endswith(".qw") or name == ".qw":
            raise Int4LayoutError(
                f"{where}: tensor '{name}': " + ("int4_shape is only allowed on a tensor named "
                                                 "'<weight>.qw'" if int4_shape is not None else
                                                 "a '.qw' tensor must carry int4_shape (packed INT4)")
                + "; rename the tensor or fix its entry")
        out, n_in = int4_shape
        sc = name[:-3] + ".sc"
        if sc not in tensors:
            raise Int4LayoutError(f"{where}: INT4 tensor '{name}' has no scale tensor '{sc}'; "
                                  f"write the pair together")
        sc_dtype, sc_shape, _ = tensors[sc]
        if sc_dtype not in INT4_SCALE_DTYPES or len(sc_shape) != 2 or sc_shape[0] != out \
                or sc_shape[1] < 1 or n_in % sc_shape[1]:
            raise Int4LayoutError(
                f"{where}: scale '{sc}' is {sc_dtype} {list(sc_shape)}; INT4 weight '{name}' "
                f"[{out}, {n_in}] needs a {'/'.join(INT4_SCALE_DTYPES)} scale [{out}, {n_in}/g] "
                f"with the input dim a multiple of the group size g")


def header_digest(preamble: bytes, header: bytes) -> bytes:
    """SHA-256 over the preamble's bytes 0 ..= 31 and the header: covers every byte that no tensor
    checksum or exact-layout rule covers (a flipped minor version or header bit is caught).
    Two updates, not a concatenation: no copy of a header of up to 64 MiB."""
    h = hashlib.sha256(preamble[:spec.DIGESTED_PREAMBLE])
    h.update(header)
    return h.digest()


def scan_json(raw: bytes) -> tuple[int, int]:
    """(maximum nesting depth of [ and {, count of the structural characters [ { , : ) outside
    JSON strings, before any parsing: no recursion, no object per value, temporaries bounded by
    the chunk size (~16 bytes per byte of a chunk). A quote is escaped when an odd run of
    backslashes precedes it; outside strings JSON has no backslashes, so this is exact for valid
    JSON, and for invalid JSON it counts at least what a parser builds before the first error."""
    depth = level = items = 0
    quotes = 0        # unescaped quotes so far: odd = inside a string
    run = 0           # backslashes ending the previous chunk
    for start in range(0, len(raw), _SCAN_CHUNK):
        a = np.frombuffer(raw, np.uint8, count=min(_SCAN_CHUNK, len(raw) - start), offset=start)
        quote = a == ord('"')
        backslash = a == ord("\\")
        if run or backslash.any():   # rare in headers: most have no escapes at all
            idx = np.arange(a.size, dtype=np.int32)
            last_plain = np.maximum.accumulate(np.where(backslash, -1 - run, idx))  # last non-backslash
            quote[0] &= run % 2 == 0
            quote[1:] &= (idx[:-1] - last_plain[:-1]) % 2 == 0   # even run of backslashes before it
            run = int(a.size - 1 - last_plain[-1])
        outside = (np.cumsum(quote, dtype=np.int32) + quotes % 2) % 2 == 0
        c = np.cumsum(_DEPTH_STEP[a] * outside, dtype=np.int32)
        depth, level = max(depth, level + int(c.max())), level + int(c[-1])
        items += int(np.count_nonzero(_ITEM[a] & outside))
        quotes += int(np.count_nonzero(quote))
    return depth, items


def check_extents(entries, header_offset: int, p: str) -> None:
    """Directory extents in order (step 6 of docs/kdtr-format.md): inside the data section,
    non-overlapping, aligned, no gaps; entries carry name, offset, nbytes."""
    end = spec.DATA_START
    for info in entries:
        name = info.name
        if info.offset < spec.DATA_START or info.offset + info.nbytes > header_offset:
            raise OffsetError(
                f"{p}: tensor '{name}': extent [{info.offset}, {info.offset + info.nbytes}) lies "
                f"outside the data section [{spec.DATA_START}, {header_offset}); {REGENERATE}")
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
    if spec.align_up(end) != header_offset:
        raise OffsetError(
            f"{p}: data ends at byte {end} but header_offset is {header_offset} "
            f"(expected {spec.align_up(end)}); {REGENERATE}")
