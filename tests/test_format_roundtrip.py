"""Byte-exact golden file, property-based round trips, and the writer's streaming/atomic promises."""
import hashlib
import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kdtr_format import (DTYPES, ChecksumError, HeaderChecksumError, KdtrError, Tensor,
                         bf16_bits, bf16_to_float32, open_kdtr, write_kdtr)

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "golden_tiny.kdtr")
GOLDEN_SHA256 = "c19735547ceca59446804da9563f8f755ddef4e43b963dd8d842415a4a7b7cee"


def golden_tensors():
    """The content of tests/data/golden_tiny.kdtr; one of each storage kind."""
    return [
        ("w", np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)),
        ("w_bf16", Tensor(np.array([0x3F80, 0xC000], np.uint16), dtype="bfloat16")),  # 1.0, -2.0
        ("mask", np.array([True, False, True])),
        ("w4.qw", Tensor(np.array([[0x76543210]], np.int32), int4_shape=(1, 8))),   # INT4 weight [1, 8]
        ("w4.sc", Tensor(np.array([[0x3F80]], np.uint16), dtype="bfloat16")),      # its scale, g = 8
        ("ids", np.array(7, np.int64)),
    ]


GOLDEN_META = {"generator": "tests/test_format_roundtrip.py", "seed": 0}


def test_golden_bytes_exact(tmp_path):
    path = tmp_path / "g.kdtr"
    write_kdtr(path, golden_tensors(), GOLDEN_META)
    got = path.read_bytes()
    assert got == open(GOLDEN, "rb").read(), "writer output drifted from tests/data/golden_tiny.kdtr"
    assert hashlib.sha256(got).hexdigest() == GOLDEN_SHA256
    # Preamble, field by field (docs/kdtr-format.md, "Preamble").
    assert got[0:8].hex(" ") == "4b 44 54 52 0d 0a 1a 0a"   # magic "KDTR\r\n\x1a\n"
    assert got[8:12].hex(" ") == "01 00 00 00"               # major 1, minor 0 (u16 LE each)
    assert got[12:16].hex(" ") == "0d 0c 0b 0a"              # byte-order mark 0x0A0B0C0D LE
    assert got[16:24].hex(" ") == "c0 01 00 00 00 00 00 00"  # header_offset 448
    header_len = int.from_bytes(got[24:32], "little")
    assert len(got) == 448 + header_len
    assert got[32:64] == hashlib.sha256(got[:32] + got[448:]).digest()   # bytes 0 ..= 31, then the header
    # Data section: w at 64, w_bf16 at 128, mask at 192, w4.qw at 256, w4.sc at 320, ids at 384.
    assert got[64:80].hex(" ") == "00 00 80 3f 00 00 00 40 00 00 40 40 00 00 80 40"
    assert got[80:128] == bytes(48)
    assert got[128:132].hex(" ") == "80 3f 00 c0"
    assert got[192:195].hex(" ") == "01 00 01"
    assert got[256:260].hex(" ") == "10 32 54 76"
    assert got[320:322].hex(" ") == "80 3f"
    assert got[384:392].hex(" ") == "07 00 00 00 00 00 00 00"
    header = json.loads(got[448:])
    assert list(header) == ["metadata", "tensors"] and header["metadata"] == GOLDEN_META
    assert header["tensors"][3] == {
        "dtype": "int32", "int4_shape": [1, 8], "name": "w4.qw", "nbytes": 4, "offset": 256,
        "sha256": hashlib.sha256(bytes.fromhex("10325476")).hexdigest(), "shape": [1, 1]}
    assert got[448:].startswith(b'{"metadata":{"generator":"tests/test_format_roundtrip.py","seed":0},'
                                b'"tensors":[{"dtype":"float32","name":"w","nbytes":16,"offset":64,')


def test_golden_reads_back():
    with open_kdtr(GOLDEN, verify=True) as f:
        assert f.names == ["w", "w_bf16", "mask", "w4.qw", "w4.sc", "ids"]
        assert f.metadata == GOLDEN_META
        assert f.info("w").offset == 64 and f.info("w4.qw").int4_shape == (1, 8)
        np.testing.assert_array_equal(f["w"], [[1, 2], [3, 4]])
        assert f["w_bf16"].dtype == np.uint16 and f["w_bf16"].tolist() == [0x3F80, 0xC000]
        assert f.get("w_bf16").tolist() == [1.0, -2.0] and f.get("w_bf16").dtype == np.float32
        assert f.get("w_bf16", to_float32=False).dtype == np.uint16
        assert f["ids"].shape == () and int(f["ids"]) == 7
        assert f["mask"].tolist() == [True, False, True]
        assert "w4.qw" in f and "nope" not in f and list(f) == f.names
        assert not f["w"].flags.writeable
        with pytest.raises(ValueError):
            f["w"][0, 0] = 9.0


def test_views_are_zero_copy():
    with open_kdtr(GOLDEN) as f:
        a, b = f["w"], f["w"]
        assert np.shares_memory(a, b)  # both views of the one mapping, no copies


def test_write_is_deterministic_and_order_preserving(tmp_path):
    write_kdtr(tmp_path / "a.kdtr", dict(golden_tensors()), {"seed": 0, "generator": "x"})
    write_kdtr(tmp_path / "b.kdtr", iter(golden_tensors()), {"generator": "x", "seed": 0})
    assert (tmp_path / "a.kdtr").read_bytes() == (tmp_path / "b.kdtr").read_bytes()


def test_big_endian_and_strided_inputs_are_normalised(tmp_path):
    x = np.arange(12, dtype=">f8").reshape(3, 4)[:, ::2]   # big-endian, non-contiguous
    write_kdtr(tmp_path / "e.kdtr", {"x": x}, {})
    with open_kdtr(tmp_path / "e.kdtr", verify=True) as f:
        assert f["x"].dtype == np.dtype("<f8")
        np.testing.assert_array_equal(f["x"], x)


def test_metadata_tuples_and_numpy_scalars_become_json(tmp_path):
    write_kdtr(tmp_path / "m.kdtr", {}, {"shape": (1, 2), "seed": np.int64(5), "lr": np.float32(0.5)})
    with open_kdtr(tmp_path / "m.kdtr", verify=True) as f:
        assert f.metadata == {"shape": [1, 2], "seed": 5, "lr": 0.5} and f.names == []


def test_bfloat16_conversion_round_to_nearest_even():
    x = np.array([1.0, -2.0, 1.00390625, 1.01171875, 3.0e38, np.inf, np.nan], np.float32)
    bits = bf16_bits(x)
    assert bits[:6].tolist() == [0x3F80, 0xC000, 0x3F80, 0x3F82, 0x7F62, 0x7F80]  # ties to even
    assert np.isnan(bf16_to_float32(bits[6:])).all()


# ---- streaming and atomic writes ---------------------------------------------------------------

def test_interrupted_write_leaves_nothing(tmp_path):
    def tensors():
        yield "a", np.ones(1000, np.float32)
        yield "b", np.ones(1000, np.float32)
        raise RuntimeError("generator died mid-way")

    with pytest.raises(RuntimeError, match="generator died mid-way"):
        write_kdtr(tmp_path / "x.kdtr", tensors(), {})
    assert os.listdir(tmp_path) == []  # no final file, no temp litter


def test_interrupted_overwrite_keeps_the_old_file(tmp_path):
    path = tmp_path / "x.kdtr"
    write_kdtr(path, {"old": np.zeros(3)}, {})
    before = path.read_bytes()

    def tensors():
        yield "new", np.ones(3)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_kdtr(path, tensors(), {})
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["x.kdtr"]


def test_invalid_tensor_mid_stream_leaves_nothing(tmp_path):
    with pytest.raises(KdtrError, match="tensor 'bad': numpy dtype complex128 is not a kdtr dtype"):
        write_kdtr(tmp_path / "x.kdtr", [("ok", np.ones(2)), ("bad", np.ones(2, complex))], {})
    assert os.listdir(tmp_path) == []


def test_streaming_holds_one_tensor_at_a_time(tmp_path):
    """Each generated tensor is released before the next is made (memory bounded by the largest)."""
    import weakref
    alive = []

    def tensors():
        for i in range(4):
            arr = np.full(1 << 16, i, np.float32)
            alive.append(weakref.ref(arr))
            yield f"t{i}", arr
            del arr
            assert sum(r() is not None for r in alive) <= 1, "writer kept an earlier tensor alive"

    write_kdtr(tmp_path / "s.kdtr", tensors(), {})
    with open_kdtr(tmp_path / "s.kdtr", verify=True) as f:
        assert [float(f[n][0]) for n in f] == [0.0, 1.0, 2.0, 3.0]


# ---- corruption is detected and named -----------------------------------------------------------

def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_flipped_data_byte_names_the_tensor(tmp_path):
    path = tmp_path / "g.kdtr"
    path.write_bytes(open(GOLDEN, "rb").read())
    _flip(path, 129)  # inside w_bf16
    with open_kdtr(path) as f:  # opening alone does not read data
        f.verify(names=["w", "mask"])
        with pytest.raises(ChecksumError, match="tensor 'w_bf16': checksum mismatch"):
            f.verify()
    with pytest.raises(ChecksumError, match="tensor 'w_bf16'"):
        open_kdtr(path, verify=True)


@pytest.mark.parametrize("offset", [9, 10, 20, 40, 460, -1])  # version, minor, header_offset, digest, header
def test_flipped_preamble_or_header_bit_is_detected(tmp_path, offset):
    path = tmp_path / "g.kdtr"
    path.write_bytes(open(GOLDEN, "rb").read())
    _flip(path, offset if offset >= 0 else path.stat().st_size - 1)
    with pytest.raises(KdtrError):
        open_kdtr(path)
    if offset in (10, 40, 460, -1):
        with pytest.raises(HeaderChecksumError, match="header checksum mismatch"):
            open_kdtr(path)


# ---- property-based round trips -----------------------------------------------------------------

# any printable name but one ending in ".qw": the format keeps that suffix for packed INT4, which must carry int4_shape
# (kdtr_format/checks.py, check_int4_pairs; its refusal is tested in test_format_spec_points.py), so such a tensor case is
# not a valid file to round-trip (a run of the suite drew {'.qw': bfloat16} and failed on the refusal)
NAMES = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=40).filter(
    lambda n: not n.endswith(".qw"))
SHAPES = st.lists(st.integers(0, 5), min_size=0, max_size=4)


@st.composite
def tensor_case(draw):
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    shape = tuple(draw(SHAPES))
    npdt = DTYPES[dtype]
    count = int(np.prod(shape))
    if dtype == "bool":
        arr = np.array(draw(st.lists(st.booleans(), min_size=count, max_size=count)), bool).reshape(shape)
    else:  # arbitrary bit patterns, NaN payloads included: the container must not touch values
        raw = draw(st.binary(min_size=count * npdt.itemsize, max_size=count * npdt.itemsize))
        arr = np.frombuffer(raw, npdt).reshape(shape)
    return Tensor(arr, dtype=dtype)


METADATA = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.text(max_size=10)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3),
    max_leaves=10)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tensors=st.dictionaries(NAMES, tensor_case(), max_size=5),
       metadata=st.dictionaries(st.text(max_size=8), METADATA, max_size=4))
def test_roundtrip_any_dtype_shape_name(tmp_path, tensors, metadata):
    path = tmp_path / "h.kdtr"
    write_kdtr(path, tensors, metadata)
    first = path.read_bytes()
    with open_kdtr(path, verify=True) as f:
        assert f.names == list(tensors) and f.metadata == metadata
        for name, t in tensors.items():
            view = f[name]
            assert f.info(name).dtype == t.dtype and view.shape == t.data.shape
            assert view.dtype == DTYPES[t.dtype] and view.tobytes() == t.data.tobytes()
            assert f.info(name).offset % 64 == 0
    write_kdtr(path, tensors, metadata)
    assert path.read_bytes() == first  # deterministic
