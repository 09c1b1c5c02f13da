"""One test per failure mode: each crafted file (or writer input) raises its own KdtrError subclass
with the documented message. Files are crafted with a valid header digest, so each reaches the
check under test rather than stopping at the checksum."""
import hashlib
import json
import os
import struct

import numpy as np
import pytest

from kdtr_format import (
    AlignmentError, ByteOrderError, ChecksumError, ClosedFileError, DuplicateNameError,
    HeaderChecksumError, HeaderFormatError, HeaderTooLargeError, InvalidDtypeError, InvalidNameError,
    InvalidShapeError, KdtrError, MetadataError, NotAKdtrFileError, OffsetError, OverlapError,
    PaddingError, SafetensorsInputError, ShapeMismatchError, Tensor, TensorNotFoundError,
    TrailingDataError, TruncatedFileError, UnsupportedVersionError, open_kdtr, write_kdtr)
from kdtr_format.interop import convert_safetensors

W = np.array([1.5, -2.0], np.float32).tobytes()   # tensor "w": 8 bytes at offset 64
W_SHA = hashlib.sha256(W).hexdigest()


def entry(**over):
    e = {"name": "w", "dtype": "float32", "shape": [2], "offset": 64, "nbytes": 8, "sha256": W_SHA}
    e.update(over)
    return {k: v for k, v in e.items() if v is not ...}


def craft(path, tensors=None, metadata=None, data=W + bytes(56), raw_header=None, major=1, minor=0,
          bom=0x0A0B0C0D, header_offset=None, header_len=None, tail=b""):
    """Write a file by hand: preamble (with a correct digest unless told otherwise) + data + header."""
    header = raw_header if raw_header is not None else json.dumps(
        {"metadata": metadata or {}, "tensors": [entry()] if tensors is None else tensors}).encode()
    hoff = 64 + len(data) if header_offset is None else header_offset
    hlen = len(header) if header_len is None else header_len
    fields = struct.pack("<8sHHIQQ", b"KDTR\r\n\x1a\n", major, minor, bom, hoff, hlen)
    path.write_bytes(fields + hashlib.sha256(fields + header).digest() + data + header + tail)
    return path


@pytest.fixture
def p(tmp_path):
    return tmp_path / "f.kdtr"


def test_crafted_baseline_is_valid(p):
    with open_kdtr(craft(p), verify=True) as f:
        assert f["w"].tolist() == [1.5, -2.0]


# ---- preamble -----------------------------------------------------------------------------------

def test_not_a_kdtr_file(p):
    p.write_bytes(b"hello world, this is text" * 10)
    with pytest.raises(NotAKdtrFileError, match=r"not a kdtr file \(first bytes 68 65 6c 6c 6f 20 77 "
                       r"6f, expected magic 4b 44 54 52 0d 0a 1a 0a\); pass a .kdtr file, or convert"):
        open_kdtr(p)


def test_empty_file_is_not_a_kdtr_file(p):
    p.write_bytes(b"")
    with pytest.raises(NotAKdtrFileError, match=r"not a kdtr file \(first bytes none"):
        open_kdtr(p)


def test_truncated_preamble(p):
    craft(p)
    p.write_bytes(p.read_bytes()[:40])
    with pytest.raises(TruncatedFileError, match="truncated: 40 bytes, shorter than the 64-byte preamble"):
        open_kdtr(p)


def test_truncated_header(p):
    craft(p)
    size = p.stat().st_size
    p.write_bytes(p.read_bytes()[:-5])
    with pytest.raises(TruncatedFileError, match=f"truncated: header ends at byte {size} but the "
                       f"file has {size - 5} bytes; regenerate the file"):
        open_kdtr(p)


def test_unsupported_version(p):
    with pytest.raises(UnsupportedVersionError, match=r"format version 2.0 is not supported \(this "
                       r"reader implements 1.x\); upgrade kdtr or regenerate"):
        open_kdtr(craft(p, major=2))


def test_byte_order_mark(p):
    with pytest.raises(ByteOrderError, match="byte-order mark 0x0D0C0B0A != 0x0A0B0C0D; kdtr files "
                       "are little-endian"):
        open_kdtr(craft(p, bom=0x0D0C0B0A))


@pytest.mark.parametrize("hlen", [0, (64 << 20) + 1, 2**64 - 1])
def test_header_too_large(p, hlen):
    with pytest.raises(HeaderTooLargeError, match=f"header_len {hlen} is outside 1..67108864"):
        open_kdtr(craft(p, header_len=hlen))


def test_header_offset_inside_preamble(p):
    with pytest.raises(OffsetError, match="header_offset 0 lies inside the 64-byte preamble"):
        open_kdtr(craft(p, header_offset=0))


def test_header_offset_misaligned(p):
    with pytest.raises(AlignmentError, match="header_offset 100 is not a multiple of 64"):
        open_kdtr(craft(p, header_offset=100))


def test_trailing_data(p):
    with pytest.raises(TrailingDataError, match=r"3 bytes follow the header \(file must end at byte"):
        open_kdtr(craft(p, tail=b"zip"))


def test_header_checksum(p):
    craft(p)
    data = bytearray(p.read_bytes())
    data[-3] ^= 0x20
    p.write_bytes(bytes(data))
    with pytest.raises(HeaderChecksumError, match=r"header checksum mismatch \(SHA-256 [0-9a-f]{16}\.\.\. "
                       r"!= preamble [0-9a-f]{16}\.\.\.\): the preamble or header is corrupt"):
        open_kdtr(p)


# ---- header JSON --------------------------------------------------------------------------------

def test_metadata_too_deep(p):
    deep = {}
    for _ in range(70):
        deep = {"a": deep}
    with pytest.raises(MetadataError, match="header JSON nests 72 deep, over the limit of 64; flatten"):
        open_kdtr(craft(p, metadata=deep))


def test_metadata_not_an_object(p):
    raw = json.dumps({"metadata": [1], "tensors": [entry()]}).encode()
    with pytest.raises(MetadataError, match="field 'metadata' is a list, not a JSON object"):
        open_kdtr(craft(p, raw_header=raw))


@pytest.mark.parametrize("raw, msg", [
    (b"\xff\xfe{}", r"header is not UTF-8 \(invalid start byte at byte 0\)"),
    (b'{"metadata": {}, "tensors": [}', r"header is not valid JSON \(Expecting value: line 1"),
    (b'{"metadata": {}, "metadata": {}, "tensors": []}', "header JSON: duplicate JSON key 'metadata'"),
    (b'{"metadata": {"x": NaN}, "tensors": []}', "header JSON: non-standard JSON constant NaN"),
    (b'[]', r"header must be a JSON object with keys \['metadata', 'tensors'\], got list"),
    (b'{"metadata": {}}', r"header must be a JSON object with keys \['metadata', 'tensors'\], got \['metadata'\]"),
    (b'{"metadata": {}, "tensors": [], "extra": 1}', r"got \['extra', 'metadata', 'tensors'\]"),
    (b'{"metadata": {}, "tensors": {}}', "field 'tensors' is a dict, not a JSON list"),
])
def test_header_format(p, raw, msg):
    with pytest.raises(HeaderFormatError, match=msg):
        open_kdtr(craft(p, raw_header=raw, data=b""))


@pytest.mark.parametrize("over, msg", [
    ({"offset": "64"}, r"tensors\[0\] \('w'\): field 'offset' = '64' is not an integer in \[0, 2\^63\)"),
    ({"nbytes": -8}, r"tensors\[0\] \('w'\): field 'nbytes' = -8 is not an integer"),
    ({"offset": 2**64}, r"field 'offset' = 18446744073709551616 is not an integer"),
    ({"offset": 64.0}, r"field 'offset' = 64.0 is not an integer"),
    ({"shape": 2}, r"field 'shape' = 2 is not a list"),
    ({"sha256": "ABC"}, r"field 'sha256' = 'ABC' is not 64 lowercase hex digits"),
    ({"int4_shape": 8}, r"field 'int4_shape' = 8 is not a list"),
    ({"sha256": ...}, r"tensors\[0\] must be an object with keys \['dtype', 'name', 'nbytes', "
                      r"'offset', 'sha256', 'shape'\] \(\+ optional int4_shape\), got \['dtype'"),
    ({"extra": 1}, r"got \['dtype', 'extra', 'name'"),
])
def test_entry_format(p, over, msg):
    with pytest.raises(HeaderFormatError, match=msg):
        open_kdtr(craft(p, tensors=[entry(**over)]))


def test_newer_minor_may_add_keys(p):
    """Minor versions only add optional keys: a 1.0 reader ignores them in a 1.1 file."""
    raw = json.dumps({"metadata": {}, "tensors": [entry(extra=1)], "future": {}}).encode()
    with open_kdtr(craft(p, raw_header=raw, minor=1), verify=True) as f:
        assert f.version == (1, 1) and f["w"].tolist() == [1.5, -2.0]


# ---- directory: extents, dtypes, shapes, names ----------------------------------------------------

def test_extent_outside_data_section(p):
    with pytest.raises(OffsetError, match=r"tensor 'w': extent \[64, 72\) lies outside the data "
                       r"section \[64, 64\)"):
        open_kdtr(craft(p, data=b""))


def test_extent_overflowing_offset(p):
    with pytest.raises(OffsetError, match=r"tensor 'w': extent \[9223372036854775807, "
                       r"9223372036854775815\) lies outside"):
        open_kdtr(craft(p, tensors=[entry(offset=2**63 - 1)]))


def test_overlap(p):
    two = [entry(), entry(name="v", offset=64)]
    with pytest.raises(OverlapError, match="tensor 'v': offset 64 is before the end 72 of the previous "
                       r"tensor \(extents must be sorted and disjoint\)"):
        open_kdtr(craft(p, tensors=two, data=W + bytes(56) + W + bytes(56)))


def test_misaligned_offset(p):
    two = [entry(), entry(name="v", offset=72)]
    with pytest.raises(AlignmentError, match="tensor 'v': offset 72 is not a multiple of 64"):
        open_kdtr(craft(p, tensors=two, data=W + bytes(56) + W + bytes(56)))


def test_gap_between_tensors(p):
    two = [entry(), entry(name="v", offset=192)]
    with pytest.raises(OffsetError, match=r"tensor 'v': offset 192 leaves a gap after byte 72 "
                       r"\(expected 128\)"):
        open_kdtr(craft(p, tensors=two, data=W + bytes(56) + bytes(64) + W + bytes(56)))


def test_gap_before_header(p):
    with pytest.raises(OffsetError, match=r"data ends at byte 72 but header_offset is 192 \(expected 128\)"):
        open_kdtr(craft(p, data=W + bytes(56) + bytes(64)))


def test_invalid_dtype(p):
    with pytest.raises(InvalidDtypeError, match="tensor 'w': dtype 'float8' is not a kdtr dtype; use "
                       "one of float64, float32, float16, bfloat16, int64, int32, int16, int8, uint8, bool"):
        open_kdtr(craft(p, tensors=[entry(dtype="float8")]))


def test_unhashable_dtype(p):  # regression: a list dtype once escaped as TypeError from a dict lookup
    with pytest.raises(InvalidDtypeError, match=r"tensor 'w': dtype \[\] is not a kdtr dtype"):
        open_kdtr(craft(p, tensors=[entry(dtype=[])]))


def test_too_many_dims(p):
    with pytest.raises(InvalidShapeError, match="tensor 'w': 9 dims exceed the limit of 8"):
        open_kdtr(craft(p, tensors=[entry(shape=[1] * 7 + [2, 1])]))


@pytest.mark.parametrize("shape", [[-2], [2**63], [True, 2], [2.0]])
def test_bad_dim(p, shape):
    with pytest.raises(InvalidShapeError, match=r"tensor 'w': dim .* is not an integer in \[0, 2\^63\)"):
        open_kdtr(craft(p, tensors=[entry(shape=shape)]))


def test_shape_nbytes_mismatch(p):
    with pytest.raises(ShapeMismatchError, match=r"tensor 'w': nbytes 8 != float32 size 4 x shape \[3\]"):
        open_kdtr(craft(p, tensors=[entry(shape=[3])]))


def test_shape_product_overflow_is_a_mismatch(p):
    # 2^62 x 2^62 x 4 bytes would wrap a 64-bit product to 0 = nbytes 0; Python ints do not wrap.
    e = entry(shape=[2**62, 2**62], nbytes=0, sha256=hashlib.sha256(b"").hexdigest())
    with pytest.raises(ShapeMismatchError, match=r"nbytes 0 != float32 size 4 x shape \[4611686018427387904"):
        open_kdtr(craft(p, tensors=[e], data=b""))


def test_int4_shape_mismatch(p):
    with pytest.raises(ShapeMismatchError, match=r"tensor 'w': int4_shape \[2, 8\] does not match packed "
                       r"float32 shape \[2\]; packed INT4 is int32 \[out, in/8\]"):
        open_kdtr(craft(p, tensors=[entry(int4_shape=[2, 8])]))


@pytest.mark.parametrize("name", ["", "tab\there", "x" * 257, "caf\u00e9", 7])
def test_invalid_name(p, name):
    with pytest.raises(InvalidNameError, match=r"is invalid; names are 1..256 printable ASCII "
                       r"characters \(0x20..0x7E\)"):
        open_kdtr(craft(p, tensors=[entry(name=name)]))


def test_duplicate_name(p):
    two = [entry(), entry(offset=128)]
    with pytest.raises(DuplicateNameError, match="tensor name 'w' appears twice"):
        open_kdtr(craft(p, tensors=two, data=W + bytes(56) + W + bytes(56)))


# ---- data ---------------------------------------------------------------------------------------

def test_checksum(p):
    with pytest.raises(ChecksumError, match=r"tensor 'w': checksum mismatch \(SHA-256 [0-9a-f]{16}\.\.\. "
                       r"!= directory " + W_SHA[:16] + r"\.\.\.\): its data is corrupt"):
        open_kdtr(craft(p, data=W[:-1] + b"\x00" + bytes(56)), verify=True)


def test_padding(p):
    with open_kdtr(craft(p, data=W + bytes(55) + b"\x01")) as f:
        f.verify(names=["w"])  # the tensor itself is intact
        with pytest.raises(PaddingError, match=r"non-zero padding in bytes \[72, 128\) after tensor 'w'"):
            f.verify()


def test_tensor_not_found(p):
    with open_kdtr(craft(p)) as f:
        with pytest.raises(TensorNotFoundError, match=r"no tensor named 'v' \(1 tensors; see `kdtr inspect`\)"):
            f["v"]
        with pytest.raises(KeyError):  # also a KeyError, as a mapping lookup should be
            f.info("v")


def test_closed_file(p):
    with open_kdtr(craft(p)) as f:
        pass
    with pytest.raises(ClosedFileError, match=r"file is closed; read tensors inside `with open_kdtr"):
        f["w"]


def test_error_classes_share_one_base():
    for cls in (NotAKdtrFileError, ChecksumError, TensorNotFoundError, SafetensorsInputError):
        assert issubclass(cls, KdtrError)


# ---- writer-side validation (nothing is left behind on failure) ----------------------------------

@pytest.mark.parametrize("tensors, cls, msg", [
    ({"w": np.zeros(2, np.uint16)}, InvalidDtypeError,
     r"tensor 'w': numpy dtype uint16 is not a kdtr dtype \(for bfloat16 bits use Tensor\(data, "
     r"dtype='bfloat16'\)\)"),
    ({"w": Tensor(np.zeros(2, np.float32), dtype="bfloat16")}, InvalidDtypeError,
     r"tensor 'w': data has numpy dtype float32 but dtype='bfloat16' needs uint16; cast the data first"),
    ({"w": Tensor(np.zeros(2, np.float32), dtype="fp8")}, InvalidDtypeError, "dtype 'fp8' is not a kdtr dtype"),
    ([("w", np.zeros(1)), ("w", np.zeros(1))], DuplicateNameError, "tensor name 'w' is given twice"),
    ({"": np.zeros(1)}, InvalidNameError, "tensor name '' is invalid"),
    ({"w": np.zeros([1] * 9)}, InvalidShapeError, "tensor 'w': 9 dims exceed the limit of 8"),
    ({"w": Tensor(np.zeros((2, 2), np.int32), int4_shape=(2, 12))}, ShapeMismatchError,
     r"tensor 'w': int4_shape \[2, 12\] does not match packed int32 shape \[2, 2\]"),
])
def test_writer_rejects_bad_tensors(tmp_path, tensors, cls, msg):
    with pytest.raises(cls, match=msg):
        write_kdtr(tmp_path / "x.kdtr", tensors, {})
    assert os.listdir(tmp_path) == []


def _nest(depth):
    m = {}
    for _ in range(depth):
        m = {"a": m}
    return m


@pytest.mark.parametrize("metadata, msg", [
    ({1: "x"}, "metadata has key 1 of type int; metadata keys must be strings"),
    ({"x": {"y": float("nan")}}, "metadata.x.y = nan; JSON has no NaN/Infinity, store it as a string"),
    ({"x": [{1, 2}]}, r"metadata.x\[0\] has type set, which is not JSON"),
    (_nest(63), "nests deeper than 63 levels; flatten the metadata"),
    ([1], "metadata is a list; pass a dict"),
])
def test_writer_rejects_bad_metadata(tmp_path, metadata, msg):
    with pytest.raises(MetadataError, match=msg):
        write_kdtr(tmp_path / "x.kdtr", {}, metadata)
    assert os.listdir(tmp_path) == []


def test_writer_depth_limit_matches_reader(tmp_path):
    write_kdtr(tmp_path / "x.kdtr", {}, _nest(62))  # 63 levels of metadata, 64 with the header
    with open_kdtr(tmp_path / "x.kdtr") as f:
        assert f.metadata == _nest(62)


def test_writer_header_too_large(tmp_path):
    with pytest.raises(HeaderTooLargeError, match="header would be 67108[0-9]+ bytes, over the limit of 67108864"):
        write_kdtr(tmp_path / "x.kdtr", {}, {"blob": "x" * (64 << 20)})
    assert os.listdir(tmp_path) == []


def test_convert_rejects_a_non_safetensors_file(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 100)
    with pytest.raises(SafetensorsInputError, match="not a valid safetensors file"):
        convert_safetensors(bad, tmp_path / "out.kdtr")
    assert sorted(os.listdir(tmp_path)) == ["bad.safetensors"]
