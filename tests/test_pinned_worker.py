"""The pinned-math worker dies with the process that started it, however that process dies: a running
`kdtr gen` killed with SIGKILL or SIGTERM leaves no process behind (refmodel/pinned.py)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent


def _children() -> dict[int, list[int]]:
    """ppid -> child pids, from /proc."""
    tree: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:                                   # exited while we looked
                continue
            tree.setdefault(int(fields[1]), []).append(int(d.name))
    return tree


def _descendants(pid: int) -> list[int]:
    tree, out, todo = _children(), [], [pid]
    while todo:
        for c in tree.get(todo.pop(), []):
            out.append(c); todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"                                        # a zombie computes nothing and holds no memory


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return "?"


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")     # utime + stime


def _pinned(pid: int) -> bool:
    try:
        return b"KDTR_PINNED_MATH=1" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def _corpus_helpers(pid: int) -> list[int]:
    """The pinned processes under `pid` whose parent is pinned too: the corpus helpers the worker forks."""
    tree = _children()
    return [c for p in _descendants(pid) if _pinned(p) for c in tree.get(p, []) if _pinned(c) and _alive(c)]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc (Linux)")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_no_process_outlives_a_killed_gen(tmp_path, sig):
    out = tmp_path / "b.kdtr"
    gen = subprocess.Popen([sys.executable, "-m", "cli.main", "gen", "--preset", "tiny", "--num-prompts", "1",
                            "--max-new-tokens", "8", "--distill-steps", "1000", "--out", str(out)],
                           cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        # wait until the distillation worker computes (killed while it still starts, it dies of the closed
        # start-up pipe anyway and proves nothing), and on a machine of several CPUs until the helpers it forks
        # for the corpus run too (refmodel/distill.py make_corpus): they must die as well
        while not (_corpus_helpers(gen.pid) if len(os.sched_getaffinity(0)) > 1 else
                   any(_pinned(p) and _cpu_seconds(p) > 3 for p in _descendants(gen.pid))):
            assert gen.poll() is None, f"kdtr gen exited with {gen.returncode} before its worker started"
            assert time.monotonic() < deadline, "no pinned worker within 120 s"
            time.sleep(0.2)
        tree = _descendants(gen.pid)
        print(f"\nprocess tree of kdtr gen {gen.pid} before {sig.name}:",
              *(f"  {p} {'pinned ' if _pinned(p) else ''}{_cmdline(p)}" for p in tree), sep="\n")
        os.kill(gen.pid, sig)
        gen.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [f"{p} {_cmdline(p)}" for p in tree if _alive(p)]
        assert not left, f"10 s after {sig.name} of kdtr gen these still run: {left}"
        assert not out.exists()
    finally:
        if gen.poll() is None:
            gen.kill()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc (Linux)")
@pytest.mark.parametrize("victim", ["worker", "corpus helper"])
def test_a_worker_killed_from_outside_ends_gen_with_one_line(tmp_path, victim):
    """The other way round: the pinned worker, or one of the corpus helpers it forks, is killed (from outside,
    or by the out-of-memory killer) and kdtr gen says so in one line, exit 130 as for any run stopped from
    outside, no traceback, no hang, no bundle written."""
    if victim == "corpus helper" and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: the corpus is made without helpers")
    out = tmp_path / "b.kdtr"
    gen = subprocess.Popen([sys.executable, "-m", "cli.main", "gen", "--preset", "tiny", "--num-prompts", "1",
                            "--max-new-tokens", "8", "--distill-steps", "1000", "--out", str(out)],
                           cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            helpers = _corpus_helpers(gen.pid)
            # the worker is at work once it has forked its corpus helpers (or, without helpers, once it has
            # computed a while): killed before, it dies of the closed start-up pipe and proves nothing
            tree = _children()
            workers = [p for p in _descendants(gen.pid) if _pinned(p) and p not in helpers
                       and (set(tree.get(p, [])) & set(helpers) or _cpu_seconds(p) > 3)]
            victims = helpers if victim == "corpus helper" else workers
            if victims:
                break
            assert gen.poll() is None, f"kdtr gen exited with {gen.returncode} before its {victim} started"
            assert time.monotonic() < deadline, f"no {victim} within 120 s"
            time.sleep(0.2)
        os.kill(victims[0], signal.SIGKILL)
        stdout, stderr = gen.communicate(timeout=60)
        said = " ".join((stdout + stderr).split())
        assert gen.returncode == 130, (gen.returncode, stderr[-2000:])
        assert "Traceback" not in said, stderr[-2000:]
        assert ("killed by SIGKILL" if victim == "worker" else "a corpus helper process of the distillation died") \
            in said, stderr[-2000:]
        assert not out.exists()
    finally:
        if gen.poll() is None:
            gen.kill()


def test_a_call_that_cannot_be_sent_fails_at_once():
    """Arguments that cannot be pickled fail the call in the caller, naming the function, and the worker is gone:
    before, the queue's feeder thread swallowed the pickling error and the call waited forever (found when a test
    passed settings of a class monkeypatched away)."""
    from refmodel.pinned import PinnedWorker

    with PinnedWorker() as w:
        pid = w.proc.pid
        with pytest.raises(TypeError, match="the pinned worker cannot be sent 'os:getpid' and its arguments"):
            w.call("os:getpid", lambda: None)                   # a lambda does not pickle
    assert not _alive(pid)


def test_a_worker_dead_before_its_call_is_reported_not_waited_on():
    """A worker killed before it read its call (here at once; in life, by the out-of-memory killer while it
    imports) fails the call with WorkerDied, even when the arguments are far larger than a pipe holds."""
    from refmodel.pinned import PinnedWorker, WorkerDied

    with PinnedWorker() as w:
        w.proc.kill()
        w.proc.join(timeout=10)
        with pytest.raises(WorkerDied, match="SIGKILL"):
            w.call("os:getpid", b"x" * (8 << 20))
