"""`kdtr import CHECKPOINT_DIR --out MODEL.kdtr`: a HF-layout Kimi K2.x / DeepseekV3 checkpoint
(INT4 experts kept packed) into one .kdtr model file. All logic is refmodel.checkpoint.import_checkpoint;
a bad checkpoint (a config or shard that is not a regular file included) is one line on stderr and
exit code ExitCode.INVALID_FILE (5); an --out that cannot be written is exit 2."""
import sys

import click
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from cli.outputs import check_output, fail_write
from conformance.exit_codes import ExitCode
from kdtr_format import KdtrError
from refmodel.checkpoint import CheckpointError, import_checkpoint
from refmodel.truncate import LayersError, import_truncated


@click.command("import")
@click.argument("checkpoint_dir", type=click.Path(exists=True, file_okay=False, readable=True))
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False, writable=True),
              help="The .kdtr model file to write (atomically).")
@click.option("--layers", type=click.IntRange(1), default=None,
              help="Import only the first N layers (with the embedding, final norm and lm_head): the model an "
                   "engine runs with num_hidden_layers = N. Only the shards holding them are read.")
def import_cmd(checkpoint_dir: str, out_path: str, layers: int | None) -> None:
    """Import CHECKPOINT_DIR (config.json + safetensors shards) into a .kdtr model file."""
    check_output(out_path, "--out")
    console = Console(stderr=True)
    columns = (TextColumn("importing"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    try:
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task("import", total=None)
            report = lambda done, total: bar.update(task, completed=done, total=total)  # noqa: E731
            summary = (import_checkpoint(checkpoint_dir, out_path, progress=report) if layers is None else
                       import_truncated(checkpoint_dir, out_path, layers, progress=report))
    except (CheckpointError, KdtrError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(int(ExitCode.USAGE if isinstance(e, LayersError) else ExitCode.INVALID_FILE))
    except OSError as e:
        fail_write(e)
    q = summary.quantization
    scheme = (f"INT4 W4A16 g{q['group_size']} ({q['scope']}, {q['scale_dtype']} scales)" if q else "no INT4")
    click.echo(f"wrote {summary.out_path}: {summary.tensors} tensors from {summary.shards} shard(s), "
               f"{summary.int4_linears} INT4 linears kept packed, {summary.dense} dense; {scheme}; "
               f"{summary.dropped} vision tensors dropped; {summary.bytes_read} bytes read")
