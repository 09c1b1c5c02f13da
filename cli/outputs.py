"""Output paths on the command line: checked before the work starts (writable, not an input, room enough),
named per bundle where one option writes one report per bundle, and a failed write reported as one line
naming the path, never a traceback. The rules themselves (atomic writes, devices and FIFOs never
replaced) are kdtr_format.paths."""
from __future__ import annotations

import os
import sys

import click
from rich.console import Console

from conformance.exit_codes import ExitCode
from conformance.report.files import STDOUT, write_error
from kdtr_format.paths import check_output_path, free_bytes, same_file


def check_output(path: str | None, hint: str, stream_ok: bool = False) -> None:
    """Raise click.BadParameter (exit 2) now, not after a long run, when path cannot be written.
    stream_ok: a device, FIFO or /dev/stdout is fine (reports); else a regular file is required."""
    if path is None or (stream_ok and path == STDOUT):
        return
    try:
        check_output_path(path, stream_ok=stream_ok)
    except OSError as e:
        raise click.BadParameter(str(e), param_hint=hint) from None


def refuse_overwriting(outputs: list[tuple[str, str | None]], inputs: list[tuple[str, str | None]]) -> None:
    """Exit 2 before any work when an output (option, path) is the same file as an input (what, path), by
    inode, so a link or a second name is caught too, or as another output: `--save-dump BUNDLE` would
    replace the golden bundle with a run dump, `--json r --html r` keep only one report."""
    outs = [(o, p) for o, p in outputs if p is not None]
    for option, out in outs:
        for what, inp in inputs:
            if inp is not None and out != STDOUT and same_file(out, inp):
                raise click.BadParameter(f"{out} is the {what} {inp} (the same file): writing it would replace "
                                         f"the {what}; pick another output path", param_hint=option)
    for i, (option, out) in enumerate(outs):
        for other, out2 in outs[:i]:
            if out == out2 == STDOUT or (STDOUT not in (out, out2) and same_file(out, out2)):
                raise click.BadParameter(f"{out} is also the path of {other} ({out2}): one would replace the "
                                         f"other; give each output its own path", param_hint=option)


def writes_stdout(path: str | None) -> bool:
    """The path is standard output: `-`, or a name of the file or pipe stdout is (/dev/stdout, /dev/fd/1)."""
    if path is None:
        return False
    if path == STDOUT:
        return True
    try:
        a, b = os.stat(path), os.fstat(sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):   # no such path, or stdout has no descriptor (captured)
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def per_bundle(path: str | None, bundles: list[str]) -> list[str | None]:
    """One report path per bundle. With one bundle, `path` itself. With several, the bundle's name goes
    before the extension (report.json -> report.model_tiny.json); where two bundles share a name, their
    parent directories are added until the names differ (a/model.kdtr, b/model.kdtr -> report.a_model.json,
    report.b_model.json). README.md documents this rule."""
    if path is None or len(bundles) < 2:
        return [path] * len(bundles)
    parts = [os.path.realpath(b).split(os.sep)[1:] for b in bundles]
    parts = [p[:-1] + [p[-1].rsplit(".", 1)[0] if "." in p[-1][1:] else p[-1]] for p in parts]
    depth = 1
    while len({tuple(p[-depth:]) for p in parts}) < len(parts) and depth < max(map(len, parts)):
        depth += 1
    tags = ["_".join(p[-depth:]) for p in parts]
    head, dot, ext = path.rpartition(".")
    if not dot or "/" in ext:
        return [f"{path}.{t}" for t in tags]
    return [f"{head}.{t}.{ext}" for t in tags]


def check_free_space(path: str, need: int, hint: str) -> None:
    """Exit 2 before the work when the file system of `path` has less than `need` bytes free."""
    try:
        free = free_bytes(path)
    except OSError:
        return                          # cannot tell (no statvfs here): the write itself will say
    if free < need:
        raise click.BadParameter(f"{path}: about {_mib(need)} needed, {_mib(free)} free on its file system; "
                                 f"free some space or write elsewhere", param_hint=hint)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def fail_write(err: OSError, prefix: str = "error") -> None:
    """Writing an output failed (disk full, a device refused, permission): one line, exit 2."""
    click.echo(f"{prefix}: {write_error(err)}", err=True)
    sys.exit(int(ExitCode.USAGE))


def make_console(stderr: bool = False) -> Console:
    """A rich console; when not a terminal (a log file, a pipe, CI) it never wraps lines at 80 columns."""
    c = Console(stderr=stderr)
    return c if c.is_terminal else Console(stderr=stderr, width=max(c.width, 4096))
