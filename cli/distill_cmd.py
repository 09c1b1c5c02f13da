"""`kdtr distill MODEL.kdtr`: train the DDTree drafter on the target's own greedy continuations and save
its weights (`drafter.*`, float64) into the model file. torch is imported only in the pinned worker."""
import sys

import click

from cli.inputs import InputPath
from cli.outputs import check_output, fail_write, make_console
from cli.progress import stage_progress
from conformance.exit_codes import ExitCode
from refmodel.distill import VECTOR_MATH_HELP, VECTOR_MATHS


@click.command("distill")
@click.argument("model", type=InputPath(dir_okay=False, readable=True))
@click.option("--steps", default=1000, show_default=True, type=click.IntRange(min=1), help="Training steps.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seeds the corpus, the init and torch.")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Write here instead of updating MODEL in place (MODEL itself: the same as leaving it out; "
                   "the update is atomic, the old file intact until the new one is whole).")
@click.option("--distill-math", "vector_math", type=click.Choice(VECTOR_MATHS), default="numpy", show_default=True,
              help=VECTOR_MATH_HELP)
def distill_cmd(model: str, steps: int, seed: int, out: str | None, vector_math: str) -> None:
    """Distill the drafter for MODEL (deterministic given --seed) and save it into the .kdtr."""
    import importlib.util
    if importlib.util.find_spec("torch") is None:      # torch runs in the pinned worker only: look, not import
        click.echo("error: kdtr distill needs torch, which is not installed here; pip install torch==2.13.0 first "
                   "(the CPU wheel; an unpinned torch pulls a CUDA build)", err=True)
        sys.exit(int(ExitCode.USAGE))
    from refmodel.distill import distill_model_file
    from kdtr_format import KdtrError
    from refmodel.pinned import WorkerDied

    check_output(out or model, "--out")
    try:
        with stage_progress(make_console(stderr=True)) as progress:
            info = distill_model_file(model, out or model, seed, steps, progress, vector_math)
    except WorkerDied as e:     # the worker was killed (from outside, out of memory)
        click.echo(f"error: {e}", err=True)
        sys.exit(int(ExitCode.INTERRUPTED))
    except (KdtrError, ValueError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(int(ExitCode.INVALID_FILE))
    except OSError as e:
        fail_write(e)
    click.echo(f"drafter distilled: {steps} steps, seed {seed}, {info['seconds']} s -> {out or model}")
