"""`kdtr gen`: make a golden bundle (conformance.gen.gen does the work)."""
from __future__ import annotations

import json
import os
import shlex
import sys

import click
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from cli.inputs import InputPath
from cli.outputs import check_free_space, check_output, fail_write, make_console, refuse_overwriting
from cli.progress import stage_progress
from conformance.exit_codes import ExitCode
from conformance.gen.bundle_model import LONG_POSITION_OFFSET
from conformance.gen.gen import GenError, GenSettings, apply_quant, generate_bundle, model_from_checkpoint, \
    model_from_kdtr, model_from_preset
from kdtr_format import KdtrError
from conformance.gen.goldens import LONG_NEW_TOKENS
from conformance.gen.size import estimate_bundle_bytes
from kdtr_format.paths import free_bytes, open_regular
from refmodel.checkpoint import CheckpointError
from refmodel.config import PRESETS
from refmodel.distill import VECTOR_MATH_HELP, VECTOR_MATHS
from refmodel.pinned import WorkerDied


def _parse_prompt_ids(text: str | None) -> list | None:
    """'1,5,9;7' -> [[1, 5, 9], [7]]: prompts separated by ';', ids by ','. Strict: an empty id or prompt
    ('1,,2', '1;;2', a trailing ',' or ';') is an error, never skipped, so what runs is what was typed."""
    if text is None:
        return None
    prompts, bad = [], None
    for p in text.split(";"):
        ids = [t.strip() for t in p.split(",")]
        if bad is None:
            bad = next((t for t in ids if not (t.isascii() and t.isdigit())), None)
        prompts.append([int(t) for t in ids if t.isascii() and t.isdigit()])
    if bad is not None:
        where = "an empty id or prompt" if bad == "" else f"{bad!r} is not a token id (an integer >= 0)"
        raise click.BadParameter(f"{text!r}: {where}; write prompts as comma-separated ids, prompts separated "
                                 f"by ';' (e.g. '12;5,7,9')", param_hint="--prompt-ids")
    return prompts


def _read_prompts(path: str | None) -> list | None:
    """A JSON file: a list of prompts, each a list of token ids."""
    if path is None:
        return None
    try:
        with open_regular(path, "prompts file") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as e:   # ValueError: not JSON, or not UTF-8
        raise click.BadParameter(f"{path}: {e}; expected JSON like [[1, 2, 3], [7]]", param_hint="--prompts")
    ok = isinstance(data, list) and data and all(
        isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in data)
    if not ok:
        raise click.BadParameter(f"{path}: expected a JSON list of non-empty id lists, like [[1, 2, 3], [7]]",
                                 param_hint="--prompts")
    return data


def _canonical_command(ctx: click.Context) -> str:
    """The command as parsed, every option spelled out (defaults too): provenance that regenerates the
    bundle whatever the shell, the option order or the kdtr defaults of the day."""
    argv = ["kdtr", ctx.info_name]
    for p in ctx.command.params:
        v = ctx.params.get(p.name)
        if v is not None:
            argv += [p.opts[0], str(v)]
    return shlex.join(argv)


@click.command("gen")
@click.option("--preset", metavar="[" + "|".join(sorted(PRESETS)) + "]", default="tiny", show_default=True,
              help="Model preset (refmodel.config.PRESETS): tiny (the committed bundles' target), shardable (for "
                   "TP/EP over 2, 4, 8 ranks), edge and wide (the widths that run every CUDA kernel path), "
                   "tiny-slice (tiny stored as K2.6 ships: bf16 dense weights, INT4 experts), k26-slice (K2.6's true "
                   "layer shapes, 3 layers), k26 (the full model: listed, refused: too "
                   "large). docs/golden-bundles.md describes each.")
@click.option("--quant", type=click.Choice(["fp32", "int4"]), default=None,
              help="fp32 weights, or INT4 W4A16 group-32 (compressed-tensors layout). Default: the model's "
                   "own (--model, --from-checkpoint), fp32 for --preset.")
@click.option("--int4-scope", type=click.Choice(["experts", "mlp"]), default="experts", show_default=True,
              help="INT4 modules: routed experts only (as K2.6 ships) or every MLP.")
@click.option("--from-checkpoint", "checkpoint", type=InputPath(file_okay=False),
              help="Take the target straight from an HF-layout checkpoint directory (read in place, never copied; "
                   "a drafter is distilled for it when --distill-steps asks and it fits in memory, else untrained).")
@click.option("--layers", type=click.IntRange(1), default=None,
              help="With --from-checkpoint: the first N layers (embedding, layers 0..N-1, final norm, lm_head), "
                   "the model an engine runs with num_hidden_layers = N. Default: every layer.")
@click.option("--model", "model_path", type=InputPath(dir_okay=False),
              help="Take target and drafter from an existing .kdtr model or bundle.")
@click.option("--prompts", "prompts_file", type=InputPath(dir_okay=False),
              help="JSON file: a list of prompts, each a list of token ids.")
@click.option("--prompt-ids", help="Prompts inline: ids separated by ',', prompts by ';' (e.g. '12;5,7,9').")
@click.option("--num-prompts", type=click.IntRange(1, 8), default=4, show_default=True,
              help="Random prompts of lengths 1, 5, 10, 18, 33, 63, 118, 224 (the first N) when none are given.")
@click.option("--max-new-tokens", type=click.IntRange(2, 4096), default=64, show_default=True,
              help="Greedy tokens generated per prompt: the golden AR stream's length (1 prefill + N-1 "
                   "decodes) and the DDTree stream's; the long-position prompt gets at most "
                   f"{LONG_NEW_TOKENS}.")
@click.option("--budget", type=click.IntRange(1, 1024), default=32, show_default=True, help="DDTree node budget.")
@click.option("--distill-steps", type=click.IntRange(0), default=1000, show_default=True,
              help="Drafter distillation steps (0: untrained drafter).")
@click.option("--distill-math", type=click.Choice(VECTOR_MATHS), default="numpy", show_default=True,
              help=VECTOR_MATH_HELP)
@click.option("--long-position", type=click.IntRange(0), default=None,
              help="First position of the long-position prompt (a random prompt whose cache holds only its own "
                   "rows); 0: none. Default: 196608, or the largest that fits the model's max_position_embeddings "
                   "(recorded in the bundle's metadata long_position). docs/golden-bundles.md says why.")
@click.option("--bf16-profile", type=bool, default=None, metavar="yes|no",
              help="Derive the bf16 precision profile (default: yes; it reruns every prompt in bf16, which "
                   "the real-shape slice skips for time). A value, not a flag, so the command recorded in "
                   "the bundle reruns as written.")
@click.option("--routing-near-ties", type=click.Choice(["forbid", "held"]), default=None,
              help="forbid (the default; held with --from-checkpoint): redraw a prompt with a routing decision near a tie (within 4x the router tolerance). "
                   "held: keep it; the float32 baseline and a live engine run the golden expert sets, and the "
                   "engine's own choice is judged by the near-tie rules (docs/conformance.md, section 3a). "
                   "For real-shape models, where 8th/9th-expert near-ties are common.")
@click.option("--seed", type=int, default=0, show_default=True, help="Weights, drafter and prompt seed.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="The bundle to write (atomically).")
def gen_cmd(preset, quant, int4_scope, checkpoint, layers, model_path, prompts_file, prompt_ids, num_prompts,
            max_new_tokens, budget, distill_steps, distill_math, long_position, bf16_profile, routing_near_ties, seed,
            out):
    """Generate a golden bundle: model, prompts, per-layer goldens, AR stream and DDTree rounds.

    The goldens are the float64 reference on the stored weights; tolerances are derived from a float32 run
    of the same reference. Prompts whose greedy margins are too close to float32 noise are rejected.
    The same command on the same machine writes the same bytes.
    """
    if checkpoint and model_path:
        raise click.UsageError("--from-checkpoint and --model both choose the model: pass one")
    if layers is not None and not checkpoint:
        raise click.UsageError("--layers truncates a checkpoint: pass it with --from-checkpoint")
    if prompts_file and prompt_ids:
        raise click.UsageError("--prompts and --prompt-ids both give prompts: pass one")
    prompts = _read_prompts(prompts_file) or _parse_prompt_ids(prompt_ids)
    check_output(out, "--out")                                               # fail now, not after the work
    refuse_overwriting([("--out", out)], [("--model", model_path), ("--prompts file", prompts_file)]
                       + [("checkpoint file", os.path.join(checkpoint, n)) for n in _files(checkpoint)])
    command = _canonical_command(click.get_current_context())
    s = GenSettings(preset=preset, quant=quant, int4_scope=int4_scope, seed=seed, prompts=prompts,
                    num_prompts=num_prompts, max_new_tokens=max_new_tokens, budget=budget,
                    distill_steps=distill_steps, distill_math=distill_math, long_position=long_position,
                    command=command,
                    bf16_profile=bf16_profile is not False, layers=layers,
                    # a real checkpoint's top-8 of hundreds of experts has near-ties in most prompts: held
                    routing_near_ties=routing_near_ties or ("held" if checkpoint else "forbid"))
    console = make_console(stderr=True)
    need = _estimate(s, model_path, checkpoint)
    if need is not None:                                                     # a full disk: say so now, not
        check_free_space(out, need, "--out")                                 # after the work
        console.print(f"bundle of about {need / 2**20:.1f} MiB ({free_bytes(out) / 2**20:.0f} MiB free there)",
                      markup=False, highlight=False, soft_wrap=True)
    try:
        with stage_progress(console) as progress:
            if model_path:
                m = model_from_kdtr(model_path, s, progress)
            elif checkpoint:
                m = model_from_checkpoint(checkpoint, s, progress)
            else:
                m = model_from_preset(s, progress)
            fig = generate_bundle(apply_quant(m, s), s, out, progress)
    except (GenError, KdtrError, CheckpointError) as e:
        console.print(f"[red]kdtr gen: {escape(str(e))}[/red]", soft_wrap=True)
        sys.exit(ExitCode.INVALID_FILE if isinstance(e, KdtrError) else ExitCode.USAGE)
    except WorkerDied as e:   # the distillation's worker was killed (from outside, out of memory)
        console.print(f"[red]kdtr gen: {escape(str(e))}[/red]", soft_wrap=True)
        sys.exit(ExitCode.INTERRUPTED)
    except OSError as e:   # writing the bundle failed (disk full, directory gone): the environment, not the input
        fail_write(e, "kdtr gen")
    table = Table(title=Text(f"bundle {out}"))   # Text: a path is printed as itself, never as markup
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("bundle size", f"{os.path.getsize(out) / 2**20:.2f} MiB")
    table.add_row("prompts x new tokens", f"{len(s.prompts) if s.prompts else num_prompts} x {max_new_tokens}")
    for k, v in _figure_rows(fig):
        table.add_row(Text(k), Text(v))
    make_console().print(table)


def _estimate(s: GenSettings, model_path, checkpoint) -> int | None:
    """The bundle's size, estimated before the work (conformance/gen/size.py); None where the model cannot
    be sized from its header (the work then says what is wrong with it)."""
    try:
        return estimate_bundle_bytes(s, model_path, checkpoint)
    except (KdtrError, CheckpointError, OSError, ValueError, KeyError, TypeError):
        return None


def _figure_rows(fig: dict, prefix: str = ""):
    """The summary figures as (name, value) rows: a nested table's entries as `long_position: prompt`, a
    list as its values separated by spaces (never a Python repr)."""
    for k, v in fig.items():
        name = f"{prefix}{k.replace('_', ' ')}"
        if isinstance(v, dict):
            yield from _figure_rows(v, f"{name}: ")
        elif isinstance(v, (list, tuple)):
            yield name, " ".join(map(str, v))
        else:
            yield name, f"{v:.6g}" if isinstance(v, float) else str(v)


def _files(directory: str | None) -> list[str]:
    """The regular files directly in a checkpoint directory (its config and shards)."""
    if directory is None:
        return []
    with os.scandir(directory) as it:
        return sorted(e.name for e in it if e.is_file())
