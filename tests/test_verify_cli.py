"""`kdtr verify` from the command line (click.testing.CliRunner on cli.main:main): the reports it writes,
its exit codes, and that a bad input is one readable message, never a traceback."""
import json
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from click.testing import CliRunner

from cli.main import main
from conformance.engines.engine_choice import EngineUnavailable, pick_engine
from conformance.exit_codes import ExitCode
from kdtr_format import Tensor, open_kdtr, write_kdtr


def kdtr(*args):
    # wide console: rich wraps table cells at the terminal width, and CliRunner's default is 80
    return CliRunner(env={"COLUMNS": "250"}).invoke(main, [str(a) for a in args])


def no_traceback(result) -> bool:
    return "Traceback" not in result.output and isinstance(result.exception, SystemExit)


@pytest.fixture(scope="module")
def reports(small_bundle, tmp_path_factory):
    """One passing run with every report and a run dump: (result, dir)."""
    d = tmp_path_factory.mktemp("reports")
    r = kdtr("verify", small_bundle, "--engine", "reference", "--json", d / "r.json", "--junit", d / "r.xml",
             "--html", d / "r.html", "--save-dump", d / "run.kdtr")
    return r, d


def test_verify_passes_and_writes_json_junit_html(reports):
    r, d = reports
    assert r.exit_code == 0, r.output
    assert "engine: reference" in r.output and "exit code 0 (OK)" in r.output
    doc = json.loads((d / "r.json").read_text())
    assert (doc["verdict"], doc["exit_code"], doc["engine"], doc["first_divergence"]) == ("pass", 0, "reference", None)
    assert len(doc["checks"]) > 150
    for c in doc["checks"]:
        assert {"name", "status", "metrics", "tolerance"} <= set(c) and c["status"] == "pass", c
    logits = next(c for c in doc["checks"] if c["name"] == "p0/prefill/logits")
    assert logits["metrics"]["max_abs"] <= logits["tolerance"]["atol"]
    suite = ET.parse(d / "r.xml").getroot()
    cases = suite.findall(".//testcase")
    assert [c.get("name") for c in cases] == [c["name"] for c in doc["checks"]]
    assert not suite.findall(".//failure") and not suite.findall(".//error")
    assert "<svg" in (d / "r.html").read_text()


def test_verify_dump_judges_a_saved_run(reports, small_bundle):
    _, d = reports
    r = kdtr("verify", small_bundle, "--dump", d / "run.kdtr", "--json", d / "dump.json")
    assert r.exit_code == 0, r.output
    doc = json.loads((d / "dump.json").read_text())
    assert doc["engine"] == "dump"
    live = [c for c in doc["checks"] if "/ddtree_live/" in c["name"]]   # --save-dump wrote the live DDTree
    assert len(live) == 5 * doc["info"]["prompts"] and all(c["status"] == "pass" for c in live)


def test_numeric_failure_exits_1_and_the_json_names_the_first_divergence(small_bundle, tmp_path):
    name = "golden/p0/prefill/L4/q"
    with open_kdtr(small_bundle) as f:
        x = np.array(f[name])
        x[0, 1, 2] += 1.0                                     # far over any fp32 tolerance
        tensors = [(n, Tensor(np.asarray(x if n == name else f[n]), dtype=f.info(n).dtype,
                              int4_shape=f.info(n).int4_shape)) for n in f.names]
        write_kdtr(tmp_path / "b.kdtr", tensors, f.metadata)
    r = kdtr("verify", tmp_path / "b.kdtr", "--engine", "reference", "--json", tmp_path / "r.json",
             "--junit", tmp_path / "r.xml")
    assert r.exit_code == ExitCode.NUMERIC, r.output
    doc = json.loads((tmp_path / "r.json").read_text())
    fd = doc["first_divergence"]
    assert (doc["verdict"], fd["name"], fd["layer"], fd["tap"], fd["worst_index"]) == \
        ("fail", "p0/prefill/L4/q", 4, "q", [0, 1, 2])
    failed = [c.get("name") for c in ET.parse(tmp_path / "r.xml").getroot().findall(".//testcase")
              if c.find("failure") is not None]
    assert failed == ["p0/prefill/L4/q"]


def test_two_bundles_write_one_report_each(small_bundle, small_int4_bundle, tmp_path):
    r = kdtr("verify", small_bundle, small_int4_bundle, "--engine", "reference", "--json", tmp_path / "r.json")
    assert r.exit_code == 0, r.output
    for stem in ("small_fp32", "small_int4"):
        assert json.loads((tmp_path / f"r.{stem}.json").read_text())["verdict"] == "pass"


def test_corrupt_bundle_exits_5_without_a_traceback(small_bundle, tmp_path):
    data = bytearray(small_bundle.read_bytes())
    with open_kdtr(small_bundle) as f:
        data[f.info("golden/p1/ar/logits").offset + 3] ^= 0x01
    (tmp_path / "bad.kdtr").write_bytes(bytes(data))
    r = kdtr("verify", tmp_path / "bad.kdtr", "--engine", "reference")
    assert r.exit_code == ExitCode.INVALID_FILE, r.output
    assert no_traceback(r), r.output
    assert "tensor 'golden/p1/ar/logits': checksum mismatch" in r.output


def test_random_blob_exits_5_saying_not_a_kdtr_file(tmp_path):
    blob = tmp_path / "blob.kdtr"
    blob.write_bytes(np.random.default_rng(0).bytes(1 << 20))
    r = kdtr("verify", blob, "--engine", "reference", "--json", tmp_path / "r.json")
    assert r.exit_code == ExitCode.INVALID_FILE, r.output
    assert no_traceback(r), r.output
    assert "not a kdtr file" in r.output
    assert json.loads((tmp_path / "r.json").read_text())["exit_name"] == "INVALID_FILE"


def test_engine_cuda_without_a_gpu_exits_6(small_bundle):
    try:
        pick_engine("cuda")
        pytest.skip("a CUDA engine can run here")
    except EngineUnavailable:
        pass
    r = kdtr("verify", small_bundle, "--engine", "cuda")
    assert r.exit_code == ExitCode.ENGINE_ERROR, r.output
    assert no_traceback(r), r.output
    assert "--engine cuda cannot run here: " in r.output and "use --engine reference" in r.output


@pytest.mark.parametrize("filename, text, says", [
    ("rules.toml", "[[rule]]\nbogus = 1\n", "rules.toml: rule 1: each rule needs a 'match' glob string"),
    ("rules.toml", '[[rule]]\nmatch = "*"\natol = -1\n', "rule 1 ('*'): 'atol' must be a number >= 0, got -1"),
    ("rules.toml", "not toml [", "Invalid value for --rules"),
    ("rules.yaml", "rule: []\n", "rules file must end in .toml or .json, got 'rules.yaml'"),
])
def test_bad_rules_file_exits_2(small_bundle, tmp_path, filename, text, says):
    (tmp_path / filename).write_text(text)
    r = kdtr("verify", small_bundle, "--engine", "reference", "--rules", tmp_path / filename)
    assert r.exit_code == ExitCode.USAGE, r.output
    assert "Invalid value for --rules" in r.output and says in r.output, r.output


@pytest.mark.parametrize("option", [["--w4a16", "fast"], ["--w4a16", "plain"], ["--dtype", "bfloat16"],
                                    ["--module", "my.port:Model"], ["--engine", "reference"]])
def test_engine_options_with_dump_are_refused_not_ignored(reports, small_bundle, option):
    """A dump is judged as it was made: an engine option beside --dump (e.g. a plain-kernel proof checked
    `--w4a16 fast`) is a usage error naming the option, before anything is judged."""
    r = kdtr("verify", small_bundle, "--dump", reports[1] / "run.kdtr", *option)
    assert r.exit_code == ExitCode.USAGE, r.output
    assert f"{option[0]} {option[1]} configures an engine that kdtr runs, but --dump judges a run already made" \
        in " ".join(r.output.split()) and no_traceback(r)
    assert "exit code" not in r.output                                  # refused before any judging
