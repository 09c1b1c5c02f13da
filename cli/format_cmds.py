"""`kdtr inspect`, `kdtr export`, `kdtr convert`: the .kdtr container from the command line.

A bad file is the user's input, not a bug: every KdtrError becomes one line on stderr and exit
code ExitCode.INVALID_FILE (5); a missing path is a usage error (2, from click)."""
import json
import sys

import click
from rich.console import Console
from rich.table import Table

from conformance.exit_codes import ExitCode
from kdtr_format import KdtrError
from kdtr_format.interop import convert_safetensors, export_safetensors
from kdtr_format.reader import describe

_FILE = click.Path(exists=True, dir_okay=False, readable=True)


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
    """Show the tensors, metadata and sizes of a .kdtr FILE."""
    try:
        info = describe(file, check=check)
    except KdtrError as e:
        _fail(e)
    if as_json:
        click.echo(json.dumps(info, indent=2, sort_keys=True))
        return
    console = Console()
    console.print(f"[bold]{info['path']}[/]  kdtr v{info['version']}  {_size(info['file_size'])}  "
                  f"{len(info['tensors'])} tensors, {_size(info['data_bytes'])} of data, "
                  f"header {_size(info['header_len'])}")
    console.print(f"header sha256 {info['header_sha256']}")
    console.print("metadata:")
    console.print_json(json.dumps(info["metadata"], sort_keys=True))
    table = Table("name", "dtype", "shape", "offset", "size", "sha256")
    for t in info["tensors"]:
        shape = "x".join(map(str, t["shape"])) or "scalar"
        if t["int4_shape"] is not None:
            shape += f" (int4 {'x'.join(map(str, t['int4_shape']))})"
        table.add_row(t["name"], t["dtype"], shape, str(t["offset"]), _size(t["nbytes"]),
                      t["sha256"][:16])
    console.print(table)
    if check:
        console.print(f"[green]checksums OK[/] ({len(info['tensors'])} tensors, "
                      f"{_size(info['data_bytes'])} verified)")


@click.command("export")
@click.argument("file", type=_FILE)
@click.option("--to", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Directory for model.safetensors and metadata.json (created if missing).")
def export_cmd(file: str, out_dir: str) -> None:
    """Export a .kdtr FILE to safetensors (+ its metadata as JSON), bit-exact."""
    try:
        st_path, meta_path = export_safetensors(file, out_dir)
    except KdtrError as e:
        _fail(e)
    click.echo(f"wrote {st_path} and {meta_path}")


@click.command("convert")
@click.argument("file", type=_FILE)
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False),
              help="The .kdtr file to write.")
def convert_cmd(file: str, out_path: str) -> None:
    """Convert a .safetensors FILE to .kdtr, bit-exact."""
    try:
        convert_safetensors(file, out_path)
    except KdtrError as e:
        _fail(e)
    click.echo(f"wrote {out_path}")
