"""What `kdtr verify` writes, and where: no output ever replaces an input (same inode: a link or a second
name is caught too), report names are unique per bundle path and each written report is named on the
console, the verdict line comes after every report was written (or names those that were not: a disk really
full, on a small tmpfs), a report to stdout gets stdout to itself, and an engine option that the engine
which will run does not have is a usage error under `--engine auto` too."""
import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
from click.testing import CliRunner

from cli.main import main
from conformance.exit_codes import ExitCode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLE = os.path.join(ROOT, "bundles", "model_int4_tiny.kdtr")
# The bundle judged as its own run dump holds no ddtree_live/ group: its 5 x 5 live DDTree checks do not run.
RAN = "560 of 585 checks ran (25 not run)"


def kdtr(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture
def bundle(tmp_path):
    """A copy of the committed INT4 bundle (judged against itself with --dump: the fastest real run)."""
    b = tmp_path / "b.kdtr"
    shutil.copy(BUNDLE, b)
    return b


def _refused(r, *needles):
    assert r.exit_code == ExitCode.USAGE, r.output
    assert "Traceback" not in r.output and all(n in r.output for n in needles), r.output


# ---- an output is never an input ------------------------------------------------------------------

@pytest.mark.parametrize("option", ["--save-dump", "--json", "--junit", "--html"])
@pytest.mark.parametrize("name", ["itself", "symlink", "hardlink"])
def test_an_output_that_is_the_bundle_is_refused_before_any_work(bundle, tmp_path, option, name):
    target = {"itself": bundle, "symlink": tmp_path / "link.kdtr", "hardlink": tmp_path / "hard.kdtr"}[name]
    if name == "symlink":
        target.symlink_to(bundle)
    elif name == "hardlink":
        os.link(bundle, target)
    before = bundle.read_bytes()
    args = ["verify", bundle, "--engine", "reference", option, target]
    r = kdtr(*args)
    _refused(r, f"{target} is the bundle {bundle} (the same file)")
    assert "engine:" not in r.output and bundle.read_bytes() == before       # refused before the run


@pytest.mark.parametrize("option", ["--json", "--junit", "--html"])
def test_a_report_onto_the_dump_or_the_rules_is_refused(bundle, tmp_path, option):
    dump, rules = tmp_path / "d.kdtr", tmp_path / "r.json"
    shutil.copy(BUNDLE, dump)
    rules.write_text('{"rule": [{"match": "*", "multiplier": 32}]}')
    _refused(kdtr("verify", bundle, "--dump", dump, option, dump), f"{dump} is the run dump {dump}")
    _refused(kdtr("verify", bundle, "--dump", dump, "--rules", rules, option, rules), f"is the rules file {rules}")


def test_two_outputs_on_one_path_are_refused(bundle, tmp_path):
    r = kdtr("verify", bundle, "--dump", bundle, "--json", tmp_path / "r", "--html", tmp_path / "r")
    _refused(r, f"{tmp_path / 'r'} is also the path of --json")


def test_gen_convert_export_import_refuse_writing_their_input(bundle, tmp_path):
    from safetensors.numpy import save_file
    import numpy as np
    st = tmp_path / "w.safetensors"
    save_file({"x": np.zeros(2, np.float32)}, str(st))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    _refused(kdtr("gen", "--model", bundle, "--out", bundle), f"{bundle} is the --model {bundle}")
    _refused(kdtr("convert", st, "--out", st), f"{st} is the input {st}")
    os.link(bundle, tmp_path / "model.safetensors")                   # export's output name, the input's inode
    _refused(kdtr("export", tmp_path / "model.safetensors", "--to", tmp_path), "is the input")
    _refused(kdtr("import", ckpt, "--out", ckpt / "config.json"), "is the checkpoint file")


# ---- report names and the console -----------------------------------------------------------------

def test_bundles_of_one_name_in_two_directories_get_two_reports(tmp_path):
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        shutil.copy(BUNDLE, tmp_path / d / "model.kdtr")
    a, b = tmp_path / "a" / "model.kdtr", tmp_path / "b" / "model.kdtr"
    r = kdtr("verify", a, b, "--engine", "reference", "--json", tmp_path / "r.json")
    assert r.exit_code == 0, r.output
    for d, bundle in (("a", a), ("b", b)):
        report = tmp_path / f"r.{d}_model.json"
        assert json.loads(report.read_text())["bundle"] == str(bundle)
        assert f"JSON report: {report}" in r.output


def test_the_same_bundle_twice_is_refused(bundle, tmp_path):
    os.link(bundle, tmp_path / "again.kdtr")
    _refused(kdtr("verify", bundle, tmp_path / "again.kdtr", "--json", tmp_path / "r.json"), "is given twice")


def test_every_report_is_named_and_the_verdict_comes_last(bundle, tmp_path):
    r = kdtr("verify", bundle, "--dump", bundle, "--json", tmp_path / "r.json", "--junit", tmp_path / "r.xml",
             "--html", tmp_path / "r.html")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[-4:-1] == [f"JSON report: {tmp_path / 'r.json'}", f"JUnit report: {tmp_path / 'r.xml'}",
                            f"HTML report: {tmp_path / 'r.html'}"]
    assert lines[-1] == f"PASS dump on {bundle}, {RAN}: exit code 0 (OK)"


@pytest.fixture
def full_dir(tmp_path):
    """A directory on a 320 KiB tmpfs: the JUnit (40 KiB) and HTML (210 KiB) reports fit, the JSON (470 KiB)
    does not. A real full file system, not a patched write (needs mount rights: root in a container)."""
    d = tmp_path / "full"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=320k", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=True)


def test_a_full_disk_writes_the_reports_that_fit_and_names_the_one_that_did_not(bundle, full_dir):
    json_path, xml_path, html_path = full_dir / "r.json", full_dir / "r.xml", full_dir / "r.html"
    r = kdtr("verify", bundle, "--dump", bundle, "--json", json_path, "--junit", xml_path, "--html", html_path)
    assert r.exit_code == ExitCode.USAGE, r.output
    lines = r.output.splitlines()
    fail = lines.index(f"JSON report NOT written: cannot write {json_path}: No space left on device")
    assert not any(ln.startswith("PASS") for ln in lines[:fail]), "a PASS line before the failure"
    assert lines[-1] == (f"PASS dump on {bundle}, {RAN}, INCOMPLETE REPORTS (not written: {json_path}): "
                         f"exit code 2 (USAGE)")
    assert ET.parse(xml_path).getroot().get("failures") == "0" and "<svg" in html_path.read_text()
    assert sorted(os.listdir(full_dir)) == ["r.html", "r.xml"]                   # no JSON, no temp file


def test_a_json_report_to_stdout_is_all_that_is_on_stdout(bundle):
    for target in ("-", "/dev/stdout"):
        r = subprocess.run([sys.executable, "-m", "cli.main", "verify", str(bundle), "--dump", str(bundle),
                            "--json", target], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["verdict"] == "pass"                       # parses: nothing else there
        assert r.stderr.splitlines()[-1] == f"PASS dump on {bundle}, {RAN}: exit code 0 (OK)"
        assert "JSON report: stdout" in r.stderr or "JSON report: /dev/stdout" in r.stderr


def test_a_stdout_report_with_several_bundles_is_refused(bundle):
    _refused(kdtr("verify", bundle, BUNDLE, "--json", "-"), "would mix their reports")


# ---- options that do not apply ------------------------------------------------------------------

def test_w4a16_under_auto_without_the_cuda_engine_is_a_usage_error(bundle):
    from conformance.engines.engine_choice import _cuda_engine_class
    if _cuda_engine_class()[0] is not None:
        pytest.skip("the CUDA engine runs here: auto picks it and --w4a16 applies")
    r = kdtr("verify", bundle, "--w4a16", "plain")
    _refused(r, "--w4a16 plain configures the CUDA engine, but auto picks the reference engine here")
    assert "PASS" not in r.output
