"""Hostile bundles stay bounded: the schema and the tensor names are checked from the header before any
byte is hashed (a declared 1 TiB extra tensor is refused at once, in constant memory), and a bundle cut
short while `kdtr verify` reads it is exit 5 with a message naming the file, never a SIGBUS. The time and
peak memory of each run are printed (pytest -s)."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from format_sparse import with_sparse_tensor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLE = os.path.join(ROOT, "bundles", "model_int4_tiny.kdtr")
TIB = 1 << 40


def _run(argv, once_open: str | None = None, then=None):
    """kdtr argv in a child: (exit code, stderr+stdout, seconds, peak resident MiB). With once_open, call
    then() while it runs: half a second after the child has the file once_open open (seen in /proc)."""
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": ROOT}, text=True)
    while once_open and proc.poll() is None:
        fds = f"/proc/{proc.pid}/fd"
        try:
            held = {os.path.realpath(os.path.join(fds, n)) for n in os.listdir(fds)}
        except OSError:
            held = set()
        if str(once_open) in held:
            time.sleep(0.5)                  # the header is parsed by now, the run under way
            then()
            break
        time.sleep(0.01)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    return os.waitstatus_to_exitcode(status), out, time.monotonic() - t0, usage.ru_maxrss / 1024


@pytest.mark.parametrize("name", ["junk", "golden/p0/ar/extra", "model.layers.0.mlp.experts.0.up_proj.bias"])
def test_a_declared_1_tib_tensor_is_refused_before_hashing(tmp_path, name):
    big = tmp_path / "big.kdtr"
    with_sparse_tensor(BUNDLE, big, name, TIB)
    assert os.path.getsize(big) > TIB and os.stat(big).st_blocks * 512 < 64 << 20      # a hole on disk
    rc, out, seconds, peak = _run(["verify", str(big), "--engine", "reference"])
    print(f"1 TiB declared as {name!r}: exit {rc} in {seconds:.1f} s, peak resident memory {peak:.0f} MiB")
    assert rc == 5, out
    assert f"tensor {name!r} ({TIB} bytes)" in out and "Traceback" not in out, out
    assert "engine:" in out and "PASS" not in out
    assert peak < 1024, f"{peak:.0f} MiB resident"      # the interpreter, numpy and the header: nothing of 1 TiB


def test_a_bundle_cut_short_while_verify_reads_it_is_exit_5(tmp_path):
    """The file is truncated to half while the run holds it open: whichever read comes next (checksums, the
    engine's weights, the judge's goldens) sees it, and the run ends with exit 5 and a message naming the
    file; before, a mapped page past the new end killed it with SIGBUS."""
    copy = tmp_path / "b.kdtr"
    shutil.copy(BUNDLE, copy)
    half = os.path.getsize(copy) // 2
    rc, out, seconds, peak = _run(["verify", str(copy), "--engine", "reference"], copy,
                                  lambda: os.truncate(copy, half))
    print(f"cut to {half} bytes mid-run: exit {rc} after {seconds:.1f} s, peak {peak:.0f} MiB")
    assert rc == 5 and rc != -signal.SIGBUS, out
    assert f"{copy}: truncated while being read" in out and "Traceback" not in out, out
    assert "ERROR bundle/integrity" in out and "exit code 5 (INVALID_FILE)" in out, out


def test_a_bundle_rewritten_while_verify_reads_it_is_exit_5(tmp_path):
    """Same size, other bytes (another process regenerating it in place): the mtime moved, exit 5."""
    copy = tmp_path / "b.kdtr"
    shutil.copy(BUNDLE, copy)

    def scribble():
        time.sleep(0.01)
        with open(copy, "r+b") as fh:
            fh.seek(4096)
            fh.write(b"\xff" * 64)
    rc, out, _, _ = _run(["verify", str(copy), "--engine", "reference"], copy, scribble)
    assert rc == 5, out
    assert ("changed while being read" in out or "checksum mismatch" in out) and "Traceback" not in out, out
