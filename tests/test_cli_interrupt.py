"""Ctrl-C during `kdtr verify`, `kdtr gen` and `kdtr distill`: exit code 130 (as shells report SIGINT, and
never 1, a numeric failure), one line saying so, the outputs that existed before left byte for byte as they
were, no temp file, and no process of the run left behind.

Each run is a real child process in its own session; the test sends SIGINT to its whole process group, as
a terminal's Ctrl-C does (the distillation worker gets it too), once the log shows the work under way."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conformance.exit_codes import ExitCode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLE = os.path.join(ROOT, "bundles", "model_int4_tiny.kdtr")


def _group(pgid: int) -> list[str]:
    """The processes of a process group: "pid command" each, read from /proc."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    command = fh.read().replace(b"\0", b" ").decode()
                out.append(f"{pid} {command[:100]}")
        except (OSError, IndexError, ValueError):
            continue                                   # gone meanwhile
    return out


def default_sigint() -> None:
    """In the child before exec: SIGINT to its default, as a terminal gives it. A test suite started in the
    background of a non-interactive shell ignores SIGINT, and an ignored signal stays ignored across exec
    (POSIX): the child would then never see the Ctrl-C this test sends."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(argv: list[str], log, ready: str, timeout: float = 240.0) -> tuple[int, str]:
    """Run kdtr argv with stderr to `log`; once `ready` is in the log, SIGINT the process group. Returns
    (exit code, log text) after checking that no process of the group outlives the run by 10 s."""
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "cli.main", *argv], cwd=ROOT, stdout=fh, stderr=fh,
                                env={**os.environ, "PYTHONPATH": ROOT}, start_new_session=True,
                                preexec_fn=default_sigint)
    try:
        t0 = time.monotonic()
        while ready not in open(log).read():
            assert proc.poll() is None, f"exited {proc.returncode} before {ready!r}: {open(log).read()}"
            assert time.monotonic() - t0 < timeout, f"no {ready!r} in {timeout} s: {open(log).read()}"
            time.sleep(0.1)
        tree = _group(proc.pid)
        print("process group at the interrupt:", *tree, sep="\n  ")
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(60)
        t1 = time.monotonic()
        while _group(proc.pid) and time.monotonic() - t1 < 10:
            time.sleep(0.2)
        left = _group(proc.pid)
        print("left 10 s after:", left or "none")
        assert not left, f"processes left behind: {left}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return rc, open(log).read()


def _temps(d) -> list[str]:
    return [n for n in os.listdir(d) if n.endswith(".kdtr-tmp")]


def test_ctrl_c_during_verify_exits_130_and_keeps_the_old_reports(tmp_path):
    report, dump = tmp_path / "r.json", tmp_path / "run.kdtr"
    report.write_text("old report\n")
    shutil.copy(BUNDLE, dump)                              # an old run dump, to be kept as it is
    before = dump.read_bytes()
    rc, log = _interrupt(["verify", BUNDLE, "--engine", "reference", "--json", str(report),
                          "--save-dump", str(dump)], tmp_path / "log", "engine: reference")
    assert rc == ExitCode.INTERRUPTED == 130, log
    assert "kdtr verify: interrupted" in log and "Aborted!" not in log and "Traceback" not in log, log
    assert report.read_text() == "old report\n" and dump.read_bytes() == before
    assert _temps(tmp_path) == [] and sorted(os.listdir(tmp_path)) == ["log", "r.json", "run.kdtr"]


@pytest.mark.parametrize("stage", ["corpus", "train"])
def test_ctrl_c_during_gen_exits_130_and_keeps_the_old_bundle(tmp_path, stage):
    """In the corpus and in training the pinned-math worker process is running: it goes too."""
    pytest.importorskip("torch")
    out = tmp_path / "b.kdtr"
    shutil.copy(BUNDLE, out)
    before = out.read_bytes()
    rc, log = _interrupt(["gen", "--num-prompts", "1", "--max-new-tokens", "8", "--distill-steps", "20",
                          "--out", str(out)], tmp_path / "log", f"{stage}: ")
    assert rc == 130, log
    assert "kdtr gen: interrupted" in log and "Traceback" not in log, log
    assert out.read_bytes() == before and _temps(tmp_path) == []


def test_ctrl_c_during_distill_exits_130_and_keeps_the_model(tmp_path):
    pytest.importorskip("torch")
    model = tmp_path / "m.kdtr"
    shutil.copy(BUNDLE, model)
    before = model.read_bytes()
    rc, log = _interrupt(["distill", str(model), "--steps", "20"], tmp_path / "log", "corpus")
    assert rc == 130, log
    assert "kdtr distill: interrupted" in log and "Traceback" not in log, log
    assert model.read_bytes() == before and _temps(tmp_path) == []
