"""Paths kdtr is given: inputs must be regular files, outputs are written atomically.

Inputs. A FIFO, a device or a socket given where a file is expected would block `open()` forever
(a FIFO without a writer) or stream endless bytes (/dev/zero). `open_regular` opens without blocking
and refuses anything that is not a regular file (symlinks to regular files are fine).

Outputs. `write_atomically` is the one atomic writer of the repository (kdtr files, safetensors
exports, reports). For a regular file (or a new path) the content goes to a temp file beside the
target, which is fsync'd, renamed over the target, and the directory fsync'd: a crash leaves the
old file or the new one, never half of one. A symlink is followed, so the link stays a link and its
target is replaced. A target that exists and is not a regular file (a device node, a FIFO,
/dev/stdout) is never replaced: it is written directly when the caller allows streaming (reports),
else refused. Temp files are named `.NAME.PID.RANDOM.kdtr-tmp`; they are removed on any exception,
on SIGINT and on SIGTERM/SIGHUP, and a later write to the same target sweeps those whose process is
gone (left by SIGKILL or a power cut).
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import signal
import stat
import threading
from typing import BinaryIO, Callable

from kdtr_format.errors import NotARegularFileError

TEMP_SUFFIX = ".kdtr-tmp"
_NAME_CHARS = 120   # of the target's name kept in the temp name: NAME_MAX is 255 bytes


class OutputPathError(OSError):
    """An output path cannot be written: its directory is missing or read-only, or it names a
    directory, or a device/FIFO where a regular file is required."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


# ---- inputs -------------------------------------------------------------------------------------

def open_regular(path, what: str = "input") -> BinaryIO:
    """Open path for binary reading; raise NotARegularFileError (a KdtrError and an OSError), without
    blocking, unless it is a regular file. O_NONBLOCK makes open() return at once on a FIFO; fstat then tells what it is."""
    path = os.fspath(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotARegularFileError(
                f"{what} {path} is {_kind(mode)}, not a regular file; pass a file (kdtr never reads "
                f"from pipes or devices: they can block forever)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def check_regular(path, what: str = "input") -> None:
    """open_regular, then close: for readers (safetensors) that need a path, not a file object."""
    open_regular(path, what).close()


# ---- outputs ------------------------------------------------------------------------------------

def check_output_path(path, stream_ok: bool = False) -> None:
    """Fail before a long run, not after it: raise OutputPathError unless write_atomically(path)
    can succeed as far as can be known now. A new file is really created (and removed) in the
    target directory, so /proc, /sys and read-only mounts are caught even for root."""
    path = os.fspath(path)
    target, st = _resolve(path, stream_ok)
    if target is None:
        if not os.access(path, os.W_OK):
            raise OutputPathError(errno.EACCES, f"cannot write {path}: permission denied")
        return
    directory = os.path.dirname(target)
    try:
        os.unlink(_create_temp(directory, os.path.basename(target)))
    except OSError as e:
        raise OutputPathError(e.errno, f"cannot write {path}: cannot create a file in {directory} "
                                       f"({e.strerror}); pick a writable directory") from None


def write_atomically(path, write: Callable[[BinaryIO], None], stream_ok: bool = False) -> None:
    """Call write(fh) to write the whole content into fh, a new binary file (seekable; `fh.name` is
    its path, for writers that need one), such that `path` ends up with that content atomically
    (see the module doc). stream_ok: a target that is a device, FIFO or descriptor (/dev/stdout)
    is written directly instead of being refused; fh is then a stream (no seek, no name) sharing
    the descriptor's offset, so `--json /dev/stdout > log` appends to the log. Only for content
    that needs no seeking (reports)."""
    path = os.fspath(path)
    target, st = _resolve(path, stream_ok)
    if target is None:
        _write_direct(path, write)
        return
    directory, name = os.path.split(target)
    sweep_stale_temps(directory, name)
    with _signals_raise():
        tmp = _temp_path(directory, name)
        try:
            _create(tmp)            # in the try: an interruption the moment the file exists still removes it
            with open(tmp, "w+b") as fh:
                write(fh)
                fh.flush()
                if st is not None:
                    os.fchmod(fh.fileno(), stat.S_IMODE(st.st_mode))   # replacing a file keeps its mode
                os.fsync(fh.fileno())
            os.replace(tmp, target)
        except BaseException as e:
            if not (isinstance(e, FileExistsError) and e.filename == tmp):    # never someone else's file
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            raise
    fsync_dir(directory)


def _resolve(path: str, stream_ok: bool) -> tuple[str | None, os.stat_result | None]:
    """(the file to replace, its stat or None when new), or (None, stat) for a target to write
    directly: an existing non-regular file, or a descriptor link such as /dev/stdout (whose
    realpath under /proc is no name to rename over). Raises OutputPathError where that is refused."""
    try:
        st = os.stat(path)          # follows every link, /dev/stdout -> /proc/self/fd/1 included
    except FileNotFoundError:
        st = None
    real = os.path.realpath(path)
    fd_link = real.startswith("/proc/") or os.path.abspath(path).startswith(("/dev/fd/", "/dev/std"))
    if st is not None and (not stat.S_ISREG(st.st_mode) or fd_link):
        if stat.S_ISDIR(st.st_mode) or not stream_ok:
            what = _kind(st.st_mode) if not stat.S_ISREG(st.st_mode) else "a file descriptor link"
            raise OutputPathError(errno.EINVAL, f"cannot write {path}: it is {what}; pass a regular "
                                                f"file path")
        return None, st
    return real, st


def _write_direct(path: str, write: Callable[[BinaryIO], None]) -> None:
    """No temp, no rename. A descriptor link (/dev/stdout, /dev/fd/N, /proc/self/fd/N) is written
    through a dup of that descriptor, so its offset is shared with the process's own writes; other
    paths are opened, a FIFO with no reader failing at once (ENXIO) rather than blocking."""
    n = _descriptor_number(path)
    if n is not None:
        fd = os.dup(n)
    else:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO:
                raise
            raise OutputPathError(e.errno, f"cannot write {path}: it is a FIFO with no reader") from None
        os.set_blocking(fd, True)
    with os.fdopen(fd, "wb") as fh:
        write(fh)


def _descriptor_number(path: str) -> int | None:
    """The descriptor a path names through the /dev/std*, /dev/fd or /proc/self/fd links, if any."""
    m = re.fullmatch(r"/dev/std(in|out|err)|/dev/fd/(\d+)|/proc/self/fd/(\d+)|/proc/%d/fd/(\d+)"
                     % os.getpid(), os.path.abspath(path))
    if m is None:
        return None
    return ("in", "out", "err").index(m[1]) if m[1] else int(m[2] or m[3] or m[4])


def sweep_stale_temps(directory: str, name: str) -> list[str]:
    """Remove temp files of earlier writes to `name` whose process no longer runs; return them."""
    prefix = f".{name[:_NAME_CHARS]}."
    removed = []
    try:
        entries = os.listdir(directory)
    except OSError:
        return removed
    for entry in entries:
        if not (entry.startswith(prefix) and entry.endswith(TEMP_SUFFIX)):
            continue
        pid = entry[len(prefix):-len(TEMP_SUFFIX)].split(".")[0]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, entry))
                removed.append(entry)
    return removed


def fsync_dir(directory: str) -> None:
    """Make a rename durable (POSIX); a no-op where directories cannot be opened or synced."""
    try:
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def _temp_path(directory: str, name: str) -> str:
    """A temp file name beside the target: the name, this process's id and 32 random bits."""
    return os.path.join(directory, f".{name[:_NAME_CHARS]}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")


def _create(tmp: str) -> None:
    # 0o666 minus the umask, like any new file; O_EXCL: never write through someone else's file.
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666))


def _create_temp(directory: str, name: str) -> str:
    """Create an empty temp file beside the target and return its path."""
    tmp = _temp_path(directory, name)
    _create(tmp)
    return tmp


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True   # someone else's live process
    return True


@contextlib.contextmanager
def _signals_raise():
    """While a temp file exists, SIGTERM and SIGHUP raise SystemExit(128 + signum) so that the
    cleanup above runs (SIGINT already raises KeyboardInterrupt). Only signals at their default
    action are taken over, and only in the main thread (where Python delivers signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None and signal.getsignal(sig) == signal.SIG_DFL:
            previous[sig] = signal.signal(sig, _raise_exit)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_exit(signum, _frame):
    raise SystemExit(128 + signum)
