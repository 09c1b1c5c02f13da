"""`kdtr inspect/export/convert` through click's CliRunner, and safetensors interop bit-exactness."""
import json
import os
import shutil

import numpy as np
import pytest
import safetensors
from click.testing import CliRunner
from safetensors.numpy import save_file

from cli.main import main
from conformance.exit_codes import ExitCode
from kdtr_format import DTYPES, Tensor, open_kdtr, write_kdtr
from kdtr_format.interop import convert_safetensors, export_safetensors

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "golden_tiny.kdtr")


def run(*args):
    return CliRunner().invoke(main, list(map(str, args)))


@pytest.fixture
def golden(tmp_path):
    path = tmp_path / "g.kdtr"
    shutil.copy(GOLDEN, path)
    return path


def test_inspect_table(golden):
    r = run("inspect", golden, "--check")
    assert r.exit_code == ExitCode.OK, r.output
    assert "kdtr v1.0" in r.output and "6 tensors" in r.output and "checksums OK" in r.output
    assert "w_bf16" in r.output and "bfloat16" in r.output and "1x1 (int4 1x8)" in r.output


def test_inspect_json(golden):
    r = run("inspect", golden, "--json")
    assert r.exit_code == ExitCode.OK, r.output
    doc = json.loads(r.output)
    assert doc["checked"] is False and doc["version"] == "1.0"
    assert [t["name"] for t in doc["tensors"]] == ["w", "w_bf16", "mask", "w4.qw", "w4.sc", "ids"]
    assert doc["tensors"][3]["int4_shape"] == [1, 8] and doc["header_offset"] == 448


def test_inspect_check_flipped_data_byte(golden):
    data = bytearray(golden.read_bytes())
    data[193] ^= 0x04  # inside "mask"
    golden.write_bytes(bytes(data))
    assert run("inspect", golden).exit_code == ExitCode.OK  # without --check the data is not read
    r = run("inspect", golden, "--check")
    assert r.exit_code == ExitCode.INVALID_FILE
    assert "error: " in r.output and "tensor 'mask': checksum mismatch" in r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1


def test_inspect_truncated(golden):
    golden.write_bytes(golden.read_bytes()[:300])
    r = run("inspect", golden, "--check")
    assert r.exit_code == ExitCode.INVALID_FILE
    assert "truncated: header ends at byte" in r.output and "Traceback" not in r.output


def test_inspect_random_blob(tmp_path):
    blob = tmp_path / "blob.bin"
    blob.write_bytes(np.random.default_rng(0).bytes(1 << 20))
    r = run("inspect", blob, "--check")
    assert r.exit_code == ExitCode.INVALID_FILE
    assert "not a kdtr file" in r.output and "Traceback" not in r.output


def test_inspect_missing_file_is_a_usage_error(tmp_path):
    r = run("inspect", tmp_path / "nope.kdtr")
    assert r.exit_code == ExitCode.USAGE and "does not exist" in r.output


def test_export_and_convert_commands(golden, tmp_path):
    r = run("export", golden, "--to", tmp_path / "out")
    assert r.exit_code == ExitCode.OK, r.output
    st_path = tmp_path / "out" / "model.safetensors"
    assert json.loads((tmp_path / "out" / "metadata.json").read_text())["seed"] == 0
    r = run("convert", st_path, "--out", tmp_path / "back.kdtr")
    assert r.exit_code == ExitCode.OK, r.output
    # metadata, INT4 shapes and order survive the trip, so the bytes are identical
    assert (tmp_path / "back.kdtr").read_bytes() == golden.read_bytes()


def test_export_of_corrupt_file_exits_5(golden, tmp_path):
    data = bytearray(golden.read_bytes())
    data[70] ^= 0x01
    golden.write_bytes(bytes(data))
    r = run("export", golden, "--to", tmp_path / "out")
    assert r.exit_code == ExitCode.INVALID_FILE and "tensor 'w': checksum mismatch" in r.output
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_convert_of_non_safetensors_exits_5(tmp_path):
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"garbage!" * 10)
    r = run("convert", bad, "--out", tmp_path / "x.kdtr")
    assert r.exit_code == ExitCode.INVALID_FILE and "not a valid safetensors file" in r.output


def _all_dtypes(rng):
    """numpy arrays for every non-bfloat16 kdtr dtype, awkward shapes included."""
    out = {}
    for i, (name, dt) in enumerate(DTYPES.items()):
        if name == "bfloat16":
            continue
        shape = [(3, 5), (7,), (), (0, 4), (2, 1, 3)][i % 5]
        if name == "bool":
            out[name] = rng.integers(0, 2, shape).astype(bool)
        else:
            out[name] = np.frombuffer(rng.bytes(int(np.prod(shape)) * dt.itemsize), dt).reshape(shape)
    return out


def test_safetensors_kdtr_safetensors_bit_exact(tmp_path):
    rng = np.random.default_rng(1)
    arrays = _all_dtypes(rng)
    st_in = tmp_path / "in.safetensors"
    save_file(arrays, str(st_in), metadata={"source": "test"})
    # bfloat16 has no numpy dtype: add it through the raw-bytes API, NaN/Inf/subnormal patterns included
    bf16 = np.array([0x3F80, 0x7FC1, 0xFF80, 0x0001, 0x8000, 0x7F7F], np.uint16).reshape(2, 3)
    tensors = {n: safetensors.TensorSpec(dtype=str(a.dtype) if a.dtype != bool else "bool",
                                         shape=list(a.shape), data_ptr=a.ctypes.data if a.nbytes else 0,
                                         data_len=a.nbytes) for n, a in arrays.items()}
    tensors["bfloat16"] = safetensors.TensorSpec(dtype="bfloat16", shape=[2, 3],
                                                 data_ptr=bf16.ctypes.data, data_len=bf16.nbytes)
    safetensors.serialize_file(tensors, str(st_in), {"source": "test"})

    convert_safetensors(st_in, tmp_path / "mid.kdtr")
    with open_kdtr(tmp_path / "mid.kdtr", verify=True) as f:
        assert sorted(f.names) == sorted(DTYPES) and f.info("bfloat16").dtype == "bfloat16"
        assert f["bfloat16"].tolist() == bf16.tolist()
        assert f.metadata == {"safetensors_metadata": {"source": "test"}}
    st_out, _ = export_safetensors(tmp_path / "mid.kdtr", tmp_path / "out")

    before = dict(safetensors.deserialize(st_in.read_bytes()))
    after = dict(safetensors.deserialize(open(st_out, "rb").read()))
    assert before.keys() == after.keys()
    for name in before:
        assert before[name]["dtype"] == after[name]["dtype"], name
        assert before[name]["shape"] == after[name]["shape"], name
        assert bytes(before[name]["data"]) == bytes(after[name]["data"]), name
    with safetensors.safe_open(st_out, framework="np") as sf:  # the numpy API reads it back too
        for name, a in arrays.items():
            np.testing.assert_array_equal(sf.get_tensor(name), a)


def test_int4_shape_survives_export(tmp_path):
    write_kdtr(tmp_path / "q.kdtr", {"x.qw": Tensor(np.ones((2, 4), np.int32), int4_shape=(2, 32)),
                                     "x.sc": np.ones((2, 1), np.float32)}, {})
    st_out, _ = export_safetensors(tmp_path / "q.kdtr", tmp_path / "out")
    convert_safetensors(st_out, tmp_path / "back.kdtr")
    with open_kdtr(tmp_path / "back.kdtr") as f:
        assert f.info("x.qw").int4_shape == (2, 32)
