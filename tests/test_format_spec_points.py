"""The points of docs/kdtr-format.md a foreign implementer found unstated, one test each: the page and
the reference reader must agree on range notation, `int4_shape: null`, INT4 pairing, what an
integer is, bool bytes, names after unescaping, `H + N` overflow, zero-size shapes, and the
header's size, item and depth limits (checked before parsing, in bounded memory)."""
import hashlib
import json
import os
import re
import struct
import threading
import tracemalloc

import numpy as np
import pytest
from test_format_errors import W, W_SHA, craft, entry

from kdtr_format import (
    HeaderFormatError, HeaderTooLargeError, Int4LayoutError, InvalidBoolError, InvalidNameError,
    InvalidShapeError, MetadataError, NotARegularFileError, Tensor, TruncatedFileError, DuplicateNameError,
    open_kdtr, spec, write_kdtr)
from kdtr_format import reader as reader_module

DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "kdtr-format.md")


@pytest.fixture
def p(tmp_path):
    return tmp_path / "f.kdtr"


# ---- notation -------------------------------------------------------------------------------------

def test_ranges_in_the_spec_use_one_notation():
    """`0..31` read as exclusive to one implementer; the page writes `a ..= b` (inclusive) or [a, b)."""
    text = open(DOC, encoding="utf-8").read()
    bare = re.findall(r"\w+\s?\.\.(?![.=])\s?\w+", text)
    assert not bare, f"ranges without ..= or [a, b) notation: {bare}"
    assert "SHA-256 of bytes 0 ..= 31 of the file" in text


def test_header_digest_covers_bytes_0_through_31_inclusive(p):
    data = craft(p).read_bytes()
    header = data[64 + 64:]
    assert data[32:64] == hashlib.sha256(data[0:32] + header).digest()   # 32 bytes: 0 ..= 31


# ---- int4_shape and INT4 pairs ------------------------------------------------------------------

def test_int4_shape_null_is_not_absent(p):
    with pytest.raises(HeaderFormatError, match=r"field 'int4_shape' = None is not a list \(omit the key"):
        open_kdtr(craft(p, tensors=[entry(int4_shape=None)]))


def _int4_pair(qw_name="m.qw", sc_name="m.sc", sc_shape=(2, 1), sc_dtype="float32", int4=(2, 8),
               qw_dtype="int32"):
    """Crafted entries of a packed [2, 8] INT4 weight (2 words) and its scale."""
    qw = np.array([1, 2], np.int32).tobytes()
    sc = bytes(4 * sc_shape[0] * sc_shape[1])
    e1 = {"name": qw_name, "dtype": qw_dtype, "shape": [2, 1], "offset": 64, "nbytes": 8,
          "sha256": hashlib.sha256(qw).hexdigest()}
    if int4 is not None:
        e1["int4_shape"] = list(int4)
    e2 = {"name": sc_name, "dtype": sc_dtype, "shape": list(sc_shape), "offset": 128, "nbytes": len(sc),
          "sha256": hashlib.sha256(sc).hexdigest()}
    data = qw + bytes(56) + sc + bytes(-len(sc) % 64)
    return [e1, e2], data


def test_int4_pair_baseline_is_valid(p):
    tensors, data = _int4_pair()
    with open_kdtr(craft(p, tensors=tensors, data=data), verify=True) as f:
        assert f.info("m.qw").int4_shape == (2, 8)


@pytest.mark.parametrize("kw, msg", [
    ({"sc_name": "m.scale"}, r"INT4 tensor 'm.qw' has no scale tensor 'm.sc'; write the pair together"),
    ({"qw_name": "m.w", "sc_name": "m.sc"}, r"tensor 'm.w': int4_shape is only allowed on a tensor named "
                                            r"'<weight>.qw'"),
    ({"int4": None}, r"tensor 'm.qw': a '.qw' tensor must carry int4_shape"),
    ({"sc_shape": (2, 3)}, r"scale 'm.sc' is float32 \[2, 3\]; INT4 weight 'm.qw' \[2, 8\] needs a "
                           r"bfloat16/float16/float32 scale \[2, 8/g\] with the input dim a multiple"),
    ({"sc_shape": (1, 1)}, r"scale 'm.sc' is float32 \[1, 1\]"),
    ({"sc_dtype": "int32"}, r"scale 'm.sc' is int32 \[2, 1\]"),
])
def test_int4_pairing_is_a_reader_obligation(p, kw, msg):
    tensors, data = _int4_pair(**kw)
    with pytest.raises(Int4LayoutError, match=msg):
        open_kdtr(craft(p, tensors=tensors, data=data))


@pytest.mark.parametrize("tensors, msg", [
    ({"m.qw": Tensor(np.ones((2, 1), np.int32), int4_shape=(2, 8))}, "has no scale tensor 'm.sc'"),
    ({"m": Tensor(np.ones((2, 1), np.int32), int4_shape=(2, 8))}, "only allowed on a tensor named"),
    ({"m.qw": np.ones((2, 1), np.int32), "m.sc": np.ones((2, 1), np.float32)}, "must carry int4_shape"),
    ({"m.qw": Tensor(np.ones((2, 1), np.int32), int4_shape=(2, 8)),
      "m.sc": np.ones((2, 3), np.float32)}, "scale 'm.sc' is float32 \\[2, 3\\]"),
])
def test_writer_enforces_int4_pairing(tmp_path, tensors, msg):
    out = tmp_path / "w.kdtr"
    with pytest.raises(Int4LayoutError, match=msg):
        write_kdtr(out, tensors, {})
    assert os.listdir(tmp_path) == []   # nothing left behind, not even a temp file


# ---- integers, bools, names -----------------------------------------------------------------------

@pytest.mark.parametrize("over, cls, msg", [
    ({"offset": 64.0}, HeaderFormatError, r"field 'offset' = 64.0 is not an integer"),
    ({"nbytes": True}, HeaderFormatError, r"field 'nbytes' = True is not an integer"),
    ({"nbytes": "8"}, HeaderFormatError, r"field 'nbytes' = '8' is not an integer"),
    ({"shape": [2.0]}, InvalidShapeError, r"dim 2.0 in shape \[2.0\] is not an integer"),
    ({"shape": [True, 2]}, InvalidShapeError, r"dim True in shape \[True, 2\] is not an integer"),
])
def test_only_plain_json_integers_are_integers(p, over, cls, msg):
    with pytest.raises(cls, match=msg):
        open_kdtr(craft(p, tensors=[entry(**over)]))


def test_exponent_form_is_not_an_integer(p):
    header = json.dumps({"metadata": {}, "tensors": [entry()]}).replace('"nbytes": 8', '"nbytes": 8e0')
    with pytest.raises(HeaderFormatError, match=r"field 'nbytes' = 8.0 is not an integer"):
        open_kdtr(craft(p, raw_header=header.encode()))


def test_minus_zero_is_the_integer_zero(tmp_path):
    path = tmp_path / "z.kdtr"
    e = {"name": "z", "dtype": "int8", "shape": [0], "offset": 64, "nbytes": 0,
         "sha256": hashlib.sha256(b"").hexdigest()}
    header = json.dumps({"metadata": {}, "tensors": [e]}).replace('"nbytes": 0', '"nbytes": -0')
    with open_kdtr(craft(path, raw_header=header.encode(), data=b""), verify=True) as f:
        assert f.info("z").nbytes == 0 and f["z"].shape == (0,)


def test_bool_bytes_other_than_0_and_1_are_rejected(p):
    data = bytes([1, 0, 2])
    e = {"name": "b", "dtype": "bool", "shape": [3], "offset": 64, "nbytes": 3,
         "sha256": hashlib.sha256(data).hexdigest()}
    path = craft(p, tensors=[e], data=data + bytes(61))
    with open_kdtr(path) as f:   # opening does not read data
        with pytest.raises(InvalidBoolError, match=r"bool tensor 'b' holds byte 2 at element 2; bool bytes "
                                                   r"must be 0 or 1"):
            f["b"]
    with pytest.raises(InvalidBoolError):
        open_kdtr(path, verify=True)


def test_name_rules_apply_after_unescaping(p, tmp_path):
    header = json.dumps({"metadata": {}, "tensors": [entry()]}).replace('"name": "w"', '"name": "\\u0041"')
    with open_kdtr(craft(p, raw_header=header.encode())) as f:
        assert f.names == ["A"]
    header = json.dumps({"metadata": {}, "tensors": [entry()]}).replace('"name": "w"', '"name": "\\u00e9"')
    assert header.isascii()
    with pytest.raises(InvalidNameError, match=r"tensor name 'é' is invalid"):
        open_kdtr(craft(tmp_path / "e.kdtr", raw_header=header.encode()))
    two = [entry(), entry(name="x", offset=128)]
    header = json.dumps({"metadata": {}, "tensors": two}).replace('"name": "x"', '"name": "\\u0077"')
    with pytest.raises(DuplicateNameError, match="tensor name 'w' appears twice"):
        open_kdtr(craft(tmp_path / "d.kdtr", raw_header=header.encode(), data=W + bytes(56) + W + bytes(56)))


# ---- sizes and limits -----------------------------------------------------------------------------

def test_header_offset_plus_len_overflowing_u64_is_truncation(p):
    """H = 2^64 - 64, N = 128: in u64, H + N wraps to 64. The file is truncated, not exact."""
    header = json.dumps({"metadata": {}, "tensors": []}).encode().ljust(128)
    fields = struct.pack("<8sHHIQQ", b"KDTR\r\n\x1a\n", 1, 0, 0x0A0B0C0D, 2**64 - 64, 128)
    p.write_bytes(fields + hashlib.sha256(fields + header).digest() + header[:64])
    with pytest.raises(TruncatedFileError, match=r"header ends at byte 18446744073709551680 but the file "
                                                 r"has 128 bytes"):
        open_kdtr(p)


def test_zero_size_tensor_with_unaddressable_dim_is_invalid(p):
    e = entry(name="z", shape=[0, 2**62], nbytes=0, sha256=hashlib.sha256(b"").hexdigest())
    with pytest.raises(InvalidShapeError, match=r"tensor 'z': zero-size shape \[0, 4611686018427387904\] has "
                                                r"non-zero dims spanning 18446744073709551616 bytes of float32"):
        open_kdtr(craft(p, tensors=[e], data=b""))


def test_zero_size_tensor_within_the_rule_reads_as_empty(p):
    e = entry(name="z", dtype="int8", shape=[0, 2**62], nbytes=0, sha256=hashlib.sha256(b"").hexdigest())
    with open_kdtr(craft(p, tensors=[e], data=b""), verify=True) as f:
        assert f["z"].shape == (0, 2**62) and f["z"].size == 0


@pytest.fixture
def no_parse(monkeypatch):
    """Fail the test if the header reaches the JSON parser."""
    def refuse(*a, **k):
        raise AssertionError("the header was parsed; the limit must be checked before parsing")
    monkeypatch.setattr(reader_module.json, "loads", refuse)


def test_item_limit_is_checked_before_parsing(p, no_parse):
    n = spec.MAX_JSON_ITEMS
    header = b'{"metadata":{"x":[' + b"0," * (n - 7) + b'0]},"tensors":[]}'   # n - 7 commas + 8 others
    with pytest.raises(HeaderTooLargeError, match=f"header JSON has {n + 1} structural characters "
                                                  rf"\(\[ {{ , :\), over the limit of {n}"):
        open_kdtr(craft(p, raw_header=header, data=b""))


def test_items_at_the_limit_parse(p):
    n = spec.MAX_JSON_ITEMS
    header = b'{"metadata":{"x":[' + b"0," * (n - 8) + b'0]},"tensors":[]}'
    with open_kdtr(craft(p, raw_header=header, data=b"")) as f:
        assert len(f.metadata["x"]) == n - 7


def test_million_levels_deep_is_rejected_before_parsing_in_bounded_memory(p, no_parse):
    header = b"[" * 1_000_000 + b"]" * 1_000_000
    craft(p, raw_header=header, data=b"")
    del header
    tracemalloc.start()
    try:
        with pytest.raises(MetadataError, match="header JSON nests 1000000 deep, over the limit of 64"):
            open_kdtr(p)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2_000_000 + (4 << 20), f"rejecting a 2 MB header took {peak} bytes"   # header + scan chunk


def test_header_size_limit_fits_a_k26_bundle():
    """The limits sized in the page: a full K2.6 bundle's directory is 31.8 MB with 2,474,750 items."""
    assert spec.MAX_HEADER_BYTES == 64 << 20 and spec.MAX_HEADER_BYTES > 1.5 * 31_792_732
    assert spec.MAX_JSON_ITEMS == 1 << 22 and spec.MAX_JSON_ITEMS > 1.5 * 2_474_750


# ---- inputs that are not regular files ------------------------------------------------------------

def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "bundle.kdtr"
    os.mkfifo(fifo)
    result = {}

    def attempt():
        try:
            open_kdtr(fifo)
        except NotARegularFileError as e:
            result["error"] = str(e)

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():   # unblock the reader so the test run can end, then fail
        with open(fifo, "wb"):
            pass
        pytest.fail("open_kdtr blocked on a FIFO")
    assert result["error"] == (f"kdtr file {fifo} is a FIFO, not a regular file; pass a file (kdtr never "
                               f"reads from pipes or devices: they can block forever)")


def test_names_are_checked_before_any_message_quotes_them(p):
    """Regression (found by the long fuzz run): a name with a newline and a bad shape gave a two-line
    shape error; the name is now checked with the entry's types, before any message quotes it."""
    with pytest.raises(InvalidNameError, match=r"tensor name 'w\\n' is invalid") as e:
        open_kdtr(craft(p, tensors=[entry(name="w\n", shape=["4"])]))
    assert "\n" not in str(e.value)
