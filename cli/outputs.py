"""Output paths on the command line: checked before the work starts, and a failed write reported as
one line with exit code 2 (usage), never a traceback. The rules themselves (atomic writes, devices
and FIFOs never replaced) are kdtr_format.paths."""
import sys

import click

from conformance.exit_codes import ExitCode
from kdtr_format.paths import OutputPathError, check_output_path


def check_output(path: str | None, hint: str, stream_ok: bool = False) -> None:
    """Raise click.BadParameter (exit 2) now, not after a long run, when path cannot be written.
    stream_ok: a device, FIFO or /dev/stdout is fine (reports); else a regular file is required."""
    if path is None:
        return
    try:
        check_output_path(path, stream_ok=stream_ok)
    except OSError as e:
        raise click.BadParameter(str(e), param_hint=hint) from None


def fail_write(err: OSError, prefix: str = "error") -> None:
    """Writing an output failed (disk full, a device refused, permission): one line, exit 2."""
    if isinstance(err, OutputPathError):
        msg = str(err)
    else:
        msg = f"cannot write {err.filename}: {err.strerror}" if err.filename and err.strerror else \
            f"cannot write: {err}"
    click.echo(f"{prefix}: {msg}", err=True)
    sys.exit(int(ExitCode.USAGE))
