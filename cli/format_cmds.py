"""`kdtr inspect`, `kdtr export`, `kdtr convert`: the .kdtr container from the command line.

A bad file is the user's input, not a bug: every KdtrError (an input that is not a regular file
included) becomes one line on stderr and exit code ExitCode.INVALID_FILE (5); a missing path or an
output that cannot be written is a usage error (2). Everything printed is plain text."""
import json
import os
import sys

import click

from cli.inputs import InputPath
from cli.outputs import check_output, fail_write, refuse_overwriting
from conformance.exit_codes import ExitCode
from kdtr_format import KdtrError
from kdtr_format.interop import META_FILE, ST_FILE, convert_safetensors, export_safetensors
from kdtr_format.describe import describe

_FILE = InputPath(dir_okay=False, readable=True)


def _fail(err: Exception) -> None:
    click.echo(f"error: {err}", err=True)
    sys.exit(int(ExitCode.INVALID_FILE))


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


@click.command("inspect")
@click.argument("file", type=_FILE)
@click.option("--check", is_flag=True, help="Verify every tensor checksum and padding byte.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON document instead of tables.")
def inspect_cmd(file: str, check: bool, as_json: bool) -> None:
    """Show the tensors, metadata and sizes of a .kdtr FILE.

    Plain text, one tensor per line with its whole name (pipe it to `less -S` for a wide table);
    --json for machines. Exit 0, or 5 with a one-line error for an invalid or corrupt file.
    """
    try:
        info = describe(file, check=check)
    except KdtrError as e:
        _fail(e)
    if as_json:
        click.echo(json.dumps(info, indent=2, sort_keys=True))
        return
    # Plain text, never rich markup: names, paths and metadata come from the file or the command
    # line, and "[/]" in any of them must print as itself.
    click.echo(f"{info['path']}  kdtr v{info['version']}  {_size(info['file_size'])}  "
               f"{len(info['tensors'])} tensors, {_size(info['data_bytes'])} of data, "
               f"header {_size(info['header_len'])}")
    click.echo(f"header sha256 {info['header_sha256']}")
    click.echo("metadata:")
    click.echo(json.dumps(info["metadata"], indent=2, sort_keys=True))
    rows = [("name", "dtype", "shape", "offset", "size", "sha256")]
    for t in info["tensors"]:
        shape = "x".join(map(str, t["shape"])) or "scalar"
        if t["int4_shape"] is not None:
            shape += f" (int4 {'x'.join(map(str, t['int4_shape']))})"
        rows.append((t["name"], t["dtype"], shape, str(t["offset"]), _size(t["nbytes"]), t["sha256"][:16]))
    for line in _columns(rows):
        click.echo(line)
    if check:
        click.echo(f"checksums OK ({len(info['tensors'])} tensors, {_size(info['data_bytes'])} verified)")


def _columns(rows: list[tuple[str, ...]]) -> list[str]:
    """Left-aligned columns, each as wide as its widest cell: whole names, whatever the terminal."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


@click.command("export")
@click.argument("file", type=_FILE)
@click.option("--to", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Directory for model.safetensors and metadata.json (created if missing).")
def export_cmd(file: str, out_dir: str) -> None:
    """Export a .kdtr FILE to safetensors (+ its metadata as JSON), bit-exact.

    Both files are written atomically. Exit 0, 2 when DIR cannot be written, 5 for an invalid FILE.
    """
    refuse_overwriting([("--to", os.path.join(out_dir, ST_FILE)), ("--to", os.path.join(out_dir, META_FILE))],
                       [("input", file)])
    try:
        st_path, meta_path = export_safetensors(file, out_dir)
    except KdtrError as e:
        _fail(e)
    except OSError as e:
        fail_write(e)
    click.echo(f"wrote {st_path} and {meta_path}")


@click.command("convert")
@click.argument("file", type=_FILE)
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False),
              help="The .kdtr file to write (atomically; a device or FIFO is refused).")
def convert_cmd(file: str, out_path: str) -> None:
    """Convert a .safetensors FILE to .kdtr, bit-exact.

    Exit 0, 2 when --out cannot be written, 5 for an invalid FILE. Interrupted (Ctrl-C, SIGTERM),
    it removes its temp file; one left by a kill -9 is swept by the next write to the same name.
    """
    check_output(out_path, "--out")
    refuse_overwriting([("--out", out_path)], [("input", file)])
    try:
        convert_safetensors(file, out_path)
    except KdtrError as e:
        _fail(e)
    except OSError as e:
        fail_write(e)
    click.echo(f"wrote {out_path}")
