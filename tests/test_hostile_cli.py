"""Hostile input on the command line: every case exits with its documented code (README: 2 usage,
5 invalid file) and a one-line error, never a traceback, never blocks, and leaves no file behind other
than the report it was asked for (and never replaces a device, FIFO or link with a regular file).

Text from files and the command line is printed as itself (`[/]` is not rich markup); FIFOs and
devices given as inputs are refused up front; report paths under /proc or /sys are refused before
the run; rules files of the wrong shape name the key."""
import json
import os
import signal
import stat
import subprocess
import sys
import time

import numpy as np
import pytest
from click.testing import CliRunner

import conformance.verify.bundles
from cli.main import main
from conformance.exit_codes import ExitCode
from conformance.report.verdict import CheckResult, make_verdict
from kdtr_format import write_kdtr
from kdtr_format.paths import TEMP_SUFFIX

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "data", "golden_tiny.kdtr")
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a device node needs root")


def kdtr(*args):
    return CliRunner(env={"COLUMNS": "80"}).invoke(main, [str(a) for a in args])


def listing(d) -> dict:
    """Every entry under d with its kind, to prove nothing was created, replaced or left behind."""
    out = {}
    for base, dirs, files in os.walk(d):
        for n in dirs + files:
            p = os.path.join(base, n)
            out[os.path.relpath(p, d)] = stat.S_IFMT(os.lstat(p).st_mode)
    return out


def one_line_error(r, code, *needles):
    """Exit `code`, no traceback, and the error (the line with the needles) on one line."""
    assert r.exit_code == code, r.output
    assert "Traceback" not in r.output and isinstance(r.exception, SystemExit), r.output
    lines = [ln for ln in r.output.splitlines() if all(n in ln for n in needles)]
    assert lines, f"no line holds {needles}: {r.output}"


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


@pytest.fixture
def markup_file(tmp_path):
    """A kdtr file whose tensor name, metadata and directory are all rich markup."""
    d = tmp_path / "[bold]dir["
    d.mkdir()
    path = d / "].kdtr"          # the path reads ".../[bold]dir[/].kdtr"
    long = "model.embed_tokens.weight." + "x" * 60
    write_kdtr(path, {"[/]": np.zeros(2, np.float32), long: np.ones(1, np.int8)},
               {"schema": "[/]", "note": "[red]not red[/red]"})
    return path, long


# ---- printing: plain text ---------------------------------------------------------------------------

def test_inspect_prints_markup_from_the_file_and_the_path_as_itself(markup_file):
    path, long = markup_file
    r = kdtr("inspect", path)
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    assert str(path) in r.output and '"schema": "[/]"' in r.output and "[red]not red[/red]" in r.output
    assert "[bold]dir[/].kdtr" in r.output and any(line.startswith("[/] ") for line in r.output.splitlines())


def test_inspect_shows_whole_names_at_80_columns(markup_file):
    path, long = markup_file
    r = kdtr("inspect", path)
    assert any(line.startswith(long + " ") for line in r.output.splitlines()), r.output


def test_export_and_convert_print_paths_as_themselves(markup_file, tmp_path):
    path, _ = markup_file
    out = tmp_path / "[x]out[" / "]"   # created by export
    r = kdtr("export", path, "--to", out)
    assert r.exit_code == 0 and f"wrote {out}/model.safetensors" in r.output, r.output
    assert "[x]out[/]" in r.output
    r = kdtr("convert", out / "model.safetensors", "--out", tmp_path / "[x]out[" / "]back.kdtr")
    assert r.exit_code == 0 and "[x]out[/]back.kdtr" in r.output, r.output


def test_gen_prints_an_output_path_with_markup(tmp_path, monkeypatch):
    """The figures table of `kdtr gen` titles itself with the --out path (the work is stubbed)."""
    import cli.gen_cmd as gen_cmd
    (tmp_path / "[red").mkdir()
    out = tmp_path / "[red" / "]bundle.kdtr"   # ".../[red/]bundle.kdtr": a closing tag with nothing open
    monkeypatch.setattr(gen_cmd, "model_from_preset", lambda s, progress: None)
    monkeypatch.setattr(gen_cmd, "apply_quant", lambda m, s: m)

    def fake_generate(m, s, path, progress):
        write_kdtr(path, {"x": np.zeros(1, np.float32)}, {})
        return {"figure": 1}
    monkeypatch.setattr(gen_cmd, "generate_bundle", fake_generate)
    r = CliRunner(env={"COLUMNS": "250"}).invoke(main, ["gen", "--out", str(out)])
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    assert "[red/]" in r.output   # rich wraps the title; the markup is printed as itself


# ---- inputs that are not regular files --------------------------------------------------------------

@pytest.mark.parametrize("command", [["inspect"], ["inspect", "--check"], ["export", "--to", "OUT"],
                                     ["convert", "--out", "OUT.kdtr"]])
def test_a_fifo_input_is_refused_up_front(fifo, tmp_path, command):
    before = listing(tmp_path)
    args = [a if not a.startswith("OUT") else tmp_path / a for a in command]
    r = kdtr(args[0], fifo, *args[1:])
    one_line_error(r, ExitCode.INVALID_FILE, "error: ", "is a FIFO, not a regular file")
    assert listing(tmp_path) == before


def test_a_device_input_is_refused(tmp_path):
    r = kdtr("inspect", "/dev/null")
    one_line_error(r, ExitCode.INVALID_FILE, "/dev/null is a character device, not a regular file")


def test_verify_refuses_a_fifo_bundle_or_dump(fifo):
    r = kdtr("verify", fifo, "--engine", "reference")
    one_line_error(r, ExitCode.INVALID_FILE, "kdtr verify: bundle", "is a FIFO, not a regular file")
    assert "engine:" not in r.output                                        # refused before any run
    r = kdtr("verify", os.path.join(ROOT, "bundles", "model_tiny.kdtr"), "--dump", fifo)
    one_line_error(r, ExitCode.INVALID_FILE, "kdtr verify: run dump", "is a FIFO, not a regular file")


def test_import_refuses_a_fifo_config(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.mkfifo(ckpt / "config.json")
    r = kdtr("import", ckpt, "--out", tmp_path / "m.kdtr")
    one_line_error(r, ExitCode.INVALID_FILE, "config.json", "is a FIFO")
    assert not (tmp_path / "m.kdtr").exists()


def test_gen_refuses_a_fifo_prompts_file(fifo, tmp_path):
    r = kdtr("gen", "--prompts", fifo, "--out", tmp_path / "b.kdtr")
    one_line_error(r, ExitCode.USAGE, "is a FIFO")


# ---- rules files ------------------------------------------------------------------------------------

RULES = {
    "list.json": ("[1, 2]", "the top level must be a table/object with the key 'rule', got a JSON list"),
    "string.json": ('"rules"', "got a JSON str"),
    "mult_list.json": ('{"rule": [{"match": "*", "multiplier": [1]}]}', "'multiplier' must be a number >= 0, got [1]"),
    "mult_dict.json": ('{"rule": [{"match": "*", "multiplier": {}}]}', "'multiplier' must be a number >= 0, got {}"),
    "mult_dict.toml": ('[[rule]]\nmatch = "*"\nmultiplier = {}\n', "'multiplier' must be a number >= 0, got {}"),
    "atol_bool.json": ('{"rule": [{"match": "*", "atol": true}]}', "'atol' must be a number >= 0, got True"),
    "huge.json": ('{"rule": [{"match": "*", "multiplier": 1' + "0" * 400 + "}]}", "'multiplier' must be a number"),
    "ulp.toml": ('[[rule]]\nmatch = "*"\nmax_ulp = 1.5\n', "'max_ulp' must be an integer >= 0, got 1.5"),
    "why.json": ('{"rule": [{"match": "*", "why": ["x"]}]}', "'why' must be a string"),
    "deep.json": ("[" * 100_000 + "]" * 100_000, "nests too deep to be a rules file"),
    "deep.toml": ("a = " + "[" * 100_000 + "]" * 100_000 + "\n", "nests too deep to be a rules file"),
    "bad.toml": ("[[rule]\n", "not valid TOML"),
    "latin1.json": (b'{"rule": [{"match": "\xe9"}]}', "not valid JSON"),
}


@pytest.mark.parametrize("name", sorted(RULES))
def test_rules_files_of_the_wrong_shape_name_the_key(tmp_path, name):
    text, msg = RULES[name]
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    before = listing(tmp_path)
    r = kdtr("verify", GOLDEN, "--dump", GOLDEN, "--rules", path)
    one_line_error(r, ExitCode.USAGE, msg)
    assert listing(tmp_path) == before


def test_a_fifo_rules_file_is_refused(tmp_path):
    path = tmp_path / "r.toml"
    os.mkfifo(path)
    r = kdtr("verify", GOLDEN, "--dump", GOLDEN, "--rules", path)
    one_line_error(r, ExitCode.USAGE, "rules file", "is a FIFO")


# ---- report and output paths ------------------------------------------------------------------------

@pytest.fixture
def stub_verify(monkeypatch):
    """A passing verdict at once: these tests are about where reports go, not about the run."""
    calls = []

    def fake(bundle, **kw):
        calls.append(bundle)
        return make_verdict("stub", bundle, [CheckResult("bundle/integrity", "pass", "integrity")])
    monkeypatch.setattr(conformance.verify.bundles, "verify", fake)
    return calls


@pytest.mark.parametrize("option, path", [("--junit", "/proc/r.xml"), ("--html", "/sys/r.html"),
                                          ("--json", "/proc/self/r.json"), ("--save-dump", "/dev/null")])
def test_unwritable_report_paths_are_refused_before_the_run(stub_verify, option, path):
    r = kdtr("verify", GOLDEN, "--dump", GOLDEN, option, path)
    one_line_error(r, ExitCode.USAGE, "cannot write", path)
    assert stub_verify == [], "the run started before the report path was checked"


def test_a_report_through_a_link_to_a_device_keeps_the_link(stub_verify, tmp_path):
    link = tmp_path / "r.json"
    link.symlink_to("/dev/null")
    r = kdtr("verify", GOLDEN, "--dump", GOLDEN, "--json", link)
    assert r.exit_code == 0, r.output
    assert link.is_symlink() and os.readlink(link) == "/dev/null"
    assert listing(tmp_path) == {"r.json": stat.S_IFLNK}


def test_a_report_to_a_descriptor_link_streams_into_it(stub_verify):
    """--json /dev/stdout: the path is a link to a descriptor; the report is written into it."""
    rfd, wfd = os.pipe()
    try:
        r = kdtr("verify", GOLDEN, "--dump", GOLDEN, "--json", f"/proc/self/fd/{wfd}")
        os.close(wfd)
        with os.fdopen(rfd, "rb") as fh:
            doc = json.loads(fh.read())
    finally:
        for fd in (rfd, wfd):
            try:
                os.close(fd)
            except OSError:
                pass
    assert r.exit_code == 0 and doc["verdict"] == "pass", r.output


@ROOT_ONLY
def test_a_full_device_fails_in_one_line_and_stays_a_device(stub_verify, tmp_path):
    """As root, `--json /dev/full` once replaced the device node with a regular file."""
    full = tmp_path / "full"
    os.mknod(full, 0o666 | stat.S_IFCHR, os.makedev(1, 7))   # a /dev/full of our own
    r = kdtr("verify", GOLDEN, "--dump", GOLDEN, "--json", full)
    one_line_error(r, ExitCode.USAGE, "JSON report NOT written: cannot write", "No space left on device")
    assert stat.S_ISCHR(os.lstat(full).st_mode)
    assert listing(tmp_path) == {"full": stat.S_IFCHR}


@pytest.mark.parametrize("command", ["convert", "import", "gen"])
def test_kdtr_outputs_refuse_devices_fifos_and_proc(fifo, tmp_path, command):
    st = tmp_path / "in.safetensors"
    from safetensors.numpy import save_file
    save_file({"x": np.zeros(2, np.float32)}, str(st))
    link = tmp_path / "null.kdtr"
    link.symlink_to("/dev/null")
    before = listing(tmp_path)
    for out in (fifo, link, "/proc/m.kdtr"):
        args = {"convert": ["convert", st, "--out", out], "import": ["import", tmp_path, "--out", out],
                "gen": ["gen", "--out", out]}[command]
        r = kdtr(*args)
        one_line_error(r, ExitCode.USAGE, "cannot write")
    assert listing(tmp_path) == before and os.readlink(link) == "/dev/null"


# ---- temp files: removed when killed, swept when left ------------------------------------------------

SLOW_CONVERT = """
import sys, time
import kdtr_format.writer as w
real = w._write_data
def slow(fh, tensors, where):
    out = real(fh, tensors, where)
    fh.flush()
    print("writing", flush=True)
    time.sleep(60)
    return out
w._write_data = slow
from cli.main import main
main(["convert", sys.argv[1], "--out", sys.argv[2]])
"""


def _default_signals():
    """The child starts with the default dispositions, as from a terminal: a test run under nohup or in a
    background job inherits SIGHUP / SIGINT ignored, and an ignored signal kills nothing."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_convert_killed_mid_write_leaves_no_temp_file(tmp_path, sig):
    from safetensors.numpy import save_file
    st = tmp_path / "in.safetensors"
    save_file({"x": np.zeros(1 << 16, np.float32)}, str(st))
    out = tmp_path / "out.kdtr"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CONVERT, str(st), str(out)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_default_signals)
    try:
        assert proc.stdout.readline() == "writing\n", proc.stderr.read()
        assert any(n.endswith(TEMP_SUFFIX) for n in os.listdir(tmp_path))   # mid-write: the temp exists
        proc.send_signal(sig)
        rc = proc.wait(30)
    finally:
        proc.kill()
    assert rc != 0 and "Traceback" not in proc.stderr.read()
    assert sorted(os.listdir(tmp_path)) == ["in.safetensors"]


def test_a_temp_file_left_by_kill_9_is_swept_by_the_next_write(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".out.kdtr.{dead.pid}.0badc0de{TEMP_SUFFIX}"
    stale.write_bytes(bytes(1000))
    live = tmp_path / f".out.kdtr.{os.getpid()}.0badc0de{TEMP_SUFFIX}"   # a live writer's: kept
    live.write_bytes(b"")
    write_kdtr(tmp_path / "out.kdtr", {"x": np.zeros(1, np.float32)}, {})
    assert sorted(os.listdir(tmp_path)) == sorted(["out.kdtr", live.name])


def test_no_temp_file_is_left_after_a_failed_write(tmp_path):
    with pytest.raises(Exception):
        write_kdtr(tmp_path / "x.kdtr", {"a": np.zeros(1, np.float32), "b": object()}, {})
    assert os.listdir(tmp_path) == []


def test_replacing_a_file_keeps_its_mode_and_a_link_keeps_pointing(tmp_path):
    target = tmp_path / "real.kdtr"
    write_kdtr(target, {"x": np.zeros(1, np.float32)}, {})
    os.chmod(target, 0o600)
    link = tmp_path / "link.kdtr"
    link.symlink_to(target.name)
    time.sleep(0.01)
    write_kdtr(link, {"y": np.ones(1, np.float32)}, {})
    assert link.is_symlink() and stat.S_IMODE(os.stat(target).st_mode) == 0o600
    from kdtr_format import open_kdtr
    with open_kdtr(target) as f:
        assert f.names == ["y"]


STDOUT_REPORT = """
from conformance.report.verdict import CheckResult, make_verdict, write_json
print("console line", flush=True)
write_json(make_verdict("stub", "b", [CheckResult("bundle/integrity", "pass", "integrity")]), "/dev/stdout")
print("after", flush=True)
"""


def test_a_report_to_dev_stdout_redirected_to_a_file_keeps_the_console_lines(tmp_path):
    """`kdtr verify --json /dev/stdout > log`: the report goes through stdout's own descriptor, so
    it neither truncates what was printed before it nor is overwritten by what follows."""
    log = tmp_path / "log"
    with open(log, "w") as fh:
        subprocess.run([sys.executable, "-c", STDOUT_REPORT], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                       stdout=fh, check=True)
    text = log.read_text()
    assert text.startswith("console line\n{") and text.endswith("}\nafter\n")
    assert json.loads(text[len("console line\n"):-len("after\n")])["verdict"] == "pass"
    assert sorted(os.listdir(tmp_path)) == ["log"]


def test_save_dump_failing_mid_run_is_named_before_the_verdict(tmp_path, monkeypatch):
    """Disk full while the run dump is written (after the up-front path check passed): the run's verdict
    still comes, after a line naming the dump and why, and says the reports are incomplete; exit 2."""
    import errno

    import conformance.verify.runner

    def full(out, path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(conformance.verify.runner, "write_dump", full)
    target = tmp_path / "run.kdtr"
    r = kdtr("verify", os.path.join(ROOT, "bundles", "model_int4_tiny.kdtr"), "--engine", "reference",
             "--save-dump", str(target), "--json", tmp_path / "r.json")
    one_line_error(r, ExitCode.USAGE, f"run dump NOT written: cannot write {target}", "No space left on device")
    lines = r.output.splitlines()
    assert lines[-1].startswith("PASS reference on") and f"INCOMPLETE REPORTS (not written: {target})" in lines[-1]
    assert lines[-2] == f"JSON report: {tmp_path / 'r.json'}"
    assert not target.exists() and json.loads((tmp_path / "r.json").read_text())["verdict"] == "pass"
