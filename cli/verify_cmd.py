"""`kdtr verify`: judge an engine (or an external engine's run dump) against golden bundles."""
from __future__ import annotations

import math
import sys

import click

from cli.inputs import InputPath
from cli.outputs import check_output, make_console, per_bundle, refuse_overwriting, writes_stdout
from conformance.engines.engine_choice import ENGINES
from conformance.precision import PROFILES
from conformance.rules_file import load_rules_file
from conformance.verify.bundles import Request, RequestError, verify_bundles
from cuda_engine.engine import W4A16_MODES
from kdtr_format.paths import same_file


@click.command("verify")
@click.argument("bundles", nargs=-1, required=True, type=InputPath(dir_okay=False))
@click.option("--engine", "engine_name", type=click.Choice(["auto"] + sorted(ENGINES)), default="auto",
              show_default=True, help="Engine under test; auto = cuda when a GPU and pycuda are present, "
                                      "else reference; torch = a PyTorch DeepseekV3 (docs/conformance.md); "
                                      "python = your own class implementing the Engine protocol, named by "
                                      "--module (docs/engine-api.md).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]),
              help="--engine torch: compute dtype (default float32).")
@click.option("--module", "module_path", metavar="PKG.MOD:CLASS",
              help="--engine torch: your own DeepseekV3 port (a torch.nn.Module with HF parameter names) instead "
                   "of transformers'; --engine python: your engine class (constructed with no arguments). "
                   "Imported with the current directory on the path. docs/engine-api.md.")
@click.option("--w4a16", type=click.Choice(W4A16_MODES),
              help="--engine cuda: INT4 expert kernels: fast (tensor cores, FP32-faithful; the default), plain "
                   "(the packed weights as stored), dense (dequantized at load). docs/cuda-engine.md.")
@click.option("--ddtree-budget", type=click.Choice(["fixed", "cost-aware"]),
              help="The live DDTree's tree budget (--engine cuda or reference): fixed = the bundle's every round "
                   "(the default); cost-aware = each tree cut to the nodes that pay for their verify rows, "
                   "priced by this GPU's measured verify times (cuda) or by --ddtree-costs; each round's budget "
                   "is declared and judged (docs/ddtree.md §3a).")
@click.option("--ddtree-costs", metavar="ROWS:COST,...",
              help="With --ddtree-budget cost-aware: the verify cost of a forward over ROWS rows, any unit, e.g. "
                   "1:1,2:1.54,5:2.34,9:3.42,17:6.1,33:10.54 (one K2.6 layer at 4096 cached rows, in AR steps; "
                   "docs/k26-scale.md); interpolated between the points.")
@click.option("--ddtree-draft-cost", type=click.FloatRange(min=0),
              help="With --ddtree-costs: the drafter's cost per round in the same unit (default 0).")
@click.option("--profile", type=click.Choice(PROFILES),
              help="Tolerance profile the bundle derived (fp32, bf16); default: the engine's dtype.")
@click.option("--dump", type=InputPath(dir_okay=False),
              help="Judge an external engine's run dump (docs/run-dump.md) instead of running an engine (so "
                   "--engine, --dtype, --module and --w4a16 do not apply: a usage error).")
@click.option("--dump-dir", type=InputPath(file_okay=False),
              help="Judge a sharded run's rank dumps rank0.kdtr .. rank{W-1}.kdtr in this folder, rank by rank "
                   "(docs/run-dump.md §7); engine options do not apply.")
@click.option("--tp", type=click.IntRange(min=1),
              help="--engine torch: run kdtr's sharded PyTorch DeepseekV3 tensor-parallel over this many rank "
                   "processes (gloo on the CPU), each rank judged through its shard.")
@click.option("--ep", type=click.IntRange(min=1),
              help="--engine torch: expert-parallel MoE over this many ranks (with --tp: the same ranks, so "
                   "--tp and --ep are equal or one of them is 1).")
@click.option("--save-dump-dir", type=click.Path(file_okay=False),
              help="With --tp/--ep: keep the rank dumps here (rank{r}.kdtr), to judge again with --dump-dir.")
@click.option("--rules", type=InputPath(dir_okay=False),
              help="Tolerance overrides: TOML/JSON, glob over check names -> rule (docs/conformance.md).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, allow_dash=True),
              help="Write the JSON report here; `-` (or /dev/stdout): to stdout, the console then on stderr. "
                   "With several BUNDLES, one report each (README.md: report names).")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False, allow_dash=True),
              help="Write a JUnit XML report here (`-`: stdout).")
@click.option("--html", "html_path", type=click.Path(dir_okay=False, allow_dash=True),
              help="Write a static HTML report here (`-`: stdout).")
@click.option("--save-dump", type=click.Path(dir_okay=False),
              help="Also write the engine's outputs as a run dump (the format external engines write); never "
                   "a bundle or other input (refused).")
@click.option("--require-coverage", "require_coverage", metavar="full|FRACTION",
              help="Fail (exit 7) unless every group of checks (prefill, decode, tokens, ddtree) ran at "
                   "least this fraction of the checks the bundle defines; `full` = 1. Default: skipped "
                   "taps are allowed, and reported.")
@click.option("-v", "--verbose", is_flag=True, help="List every check, not only failures.")
def verify_cmd(bundles, engine_name, dtype, module_path, w4a16, ddtree_budget, ddtree_costs, ddtree_draft_cost, profile, dump, dump_dir, tp, ep, save_dump_dir, rules,
               json_path, junit_path, html_path, save_dump, require_coverage, verbose):
    """Verify an engine against golden BUNDLES: every tap of every layer, the AR token stream and
    the DDTree rounds. Exit 0 pass, 1 numeric, 2 usage (or a report not written), 3 tokens, 4 DDTree,
    5 invalid/corrupt bundle or dump, 6 engine error, 7 coverage below --require-coverage, 130
    interrupted (the most severe wins when several occur: 5 > 6 > 3 > 4 > 1 > 7 > 2). The verdict line
    comes last, after every report is written; each report written is named.
    """
    console = make_console(stderr=True)
    coverage = _coverage_fraction(require_coverage)
    try:
        overrides = load_rules_file(rules) if rules else ()
    except (OSError, ValueError) as e:
        raise click.BadParameter(str(e), param_hint="--rules") from None
    reports = {"--json": json_path, "--junit": junit_path, "--html": html_path}
    for hint, path in reports.items():
        check_output(path, hint, stream_ok=True)    # a report may go to a device or /dev/stdout
    check_output(save_dump, "--save-dump")          # a .kdtr needs a regular file (it is seeked)
    if dump and len(bundles) > 1:
        raise click.UsageError("--dump judges one run against one bundle: pass a single BUNDLE")
    if dump and dump_dir:
        raise click.UsageError("--dump judges one run dump, --dump-dir a sharded run's rank dumps: pass one of them")
    ddtree = _ddtree_options(ddtree_budget, ddtree_costs, ddtree_draft_cost)
    if dump or dump_dir:
        _refuse_engine_options(engine_name, dtype, module_path, w4a16, tp, ep, "--dump" if dump else "--dump-dir")
        if ddtree:
            raise click.UsageError(f"{'--dump' if dump else '--dump-dir'} judges a run already made: the "
                                   f"--ddtree-* options configure an engine run, drop them")
    if ddtree and (tp is not None or ep is not None):
        raise click.UsageError("--ddtree-budget and its costs apply to --engine cuda or reference, not to a sharded "
                               "--tp/--ep run")
    if dump_dir and len(bundles) > 1:
        raise click.UsageError("--dump-dir judges one run against one bundle: pass a single BUNDLE")
    if dump_dir and (save_dump or save_dump_dir):
        raise click.UsageError("--dump-dir judges rank dumps already written: drop --save-dump/--save-dump-dir")
    if tp is not None or ep is not None:
        _check_sharded_options(engine_name, dtype, module_path, save_dump)
    elif save_dump_dir:
        raise click.UsageError("--save-dump-dir keeps a sharded run's rank dumps: give --tp or --ep (else --save-dump)")
    to_stdout = _stdout_report(reports, len(bundles))
    paths = {hint: per_bundle(path, list(bundles)) for hint, path in (*reports.items(), ("--save-dump", save_dump))}
    _refuse_repeats(bundles)
    refuse_overwriting([(hint, p) for hint, ps in paths.items() for p in dict.fromkeys(ps)],
                       [("bundle", b) for b in bundles] + [("run dump", dump), ("rules file", rules)])
    request = Request(bundles=list(bundles), save_dump_dirs=per_bundle(save_dump_dir, list(bundles)),
                      outputs={"json": paths["--json"], "junit": paths["--junit"], "html": paths["--html"],
                               "save_dump": paths["--save-dump"]},
                      engine=engine_name, dtype=dtype, module=module_path, w4a16=w4a16, ddtree=ddtree, tp=tp, ep=ep, dump=dump,
                      dump_dir=dump_dir, overrides=overrides, profile=profile, require_coverage=coverage,
                      verbose=verbose)
    try:        # the console's own lines (the verdicts): stdout, unless a report takes it
        worst = verify_bundles(request, console, make_console(stderr=to_stdout))
    except RequestError as e:
        raise click.UsageError(str(e)) from None
    sys.exit(int(worst))


def _ddtree_options(budget, costs_text, draft_cost) -> dict | None:
    """The --ddtree-* options as pick_engine's `ddtree` (None when none is given); a usage error names a bad
    cost table, or costs given without the cost-aware budget."""
    if budget is None and costs_text is None and draft_cost is None:
        return None
    if budget != "cost-aware" and (costs_text is not None or draft_cost is not None):
        raise click.UsageError("--ddtree-costs and --ddtree-draft-cost price the cost-aware budget: add "
                               "--ddtree-budget cost-aware")
    if draft_cost is not None and not math.isfinite(draft_cost):
        raise click.BadParameter(f"{draft_cost}: give a finite cost (0 or more)", param_hint="--ddtree-draft-cost")
    if draft_cost is not None and costs_text is None:
        raise click.UsageError("--ddtree-draft-cost is in the unit of --ddtree-costs: give both (without them the "
                               "CUDA engine measures its own)")
    from refmodel.ddtree import parse_verify_costs

    try:
        costs = parse_verify_costs(costs_text) if costs_text is not None else None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--ddtree-costs") from None
    return {"budget": budget or "fixed", "costs": costs, "draft_cost": draft_cost or 0.0}


def _stdout_report(reports: dict, n_bundles: int) -> bool:
    """True when a report goes to stdout; then it must be the only thing there (one report, one bundle)."""
    to = [hint for hint, path in reports.items() if writes_stdout(path)]
    if len(to) > 1:
        raise click.UsageError(f"{' and '.join(to)} both write to stdout: one report can go there, the others to files")
    if to and n_bundles > 1:
        raise click.UsageError(f"{to[0]} to stdout with {n_bundles} bundles would mix their reports: give a file "
                               f"name (one report per bundle is written beside it) or one BUNDLE")
    return bool(to)


def _refuse_repeats(bundles) -> None:
    for i, b in enumerate(bundles):
        for b0 in bundles[:i]:
            if same_file(b, b0):
                raise click.UsageError(f"BUNDLE {b} is given twice (also as {b0}): its reports would have one name")


def _refuse_engine_options(engine_name, dtype, module_path, w4a16, tp=None, ep=None, flag="--dump") -> None:
    """With --dump (or --dump-dir) no engine runs: an engine option would be silently ignored (a dump made
    with --w4a16 plain would pass as `--w4a16 fast`), so it is a usage error naming the option."""
    given = [("--engine", engine_name if engine_name != "auto" else None), ("--dtype", dtype),
             ("--module", module_path), ("--w4a16", w4a16), ("--tp", tp), ("--ep", ep)]
    for option, value in given:
        if value:
            raise click.UsageError(f"{option} {value} configures an engine that kdtr runs, but {flag} judges a run "
                                   f"already made, as it was made (its metadata engine_info records how): drop "
                                   f"{option} or drop {flag}")


def _check_sharded_options(engine_name, dtype, module_path, save_dump) -> None:
    """--tp/--ep run kdtr's own sharded torch model in float32: other engine options are usage errors."""
    if engine_name != "torch":
        raise click.UsageError(f"--tp/--ep shard the torch engine: pass --engine torch (not --engine {engine_name})")
    if module_path or (dtype and dtype != "float32"):
        raise click.UsageError("--tp/--ep run kdtr's own sharded PyTorch DeepseekV3 in float32: drop "
                               + ("--module" if module_path else f"--dtype {dtype}"))
    if save_dump:
        raise click.UsageError("a sharded run writes one dump per rank: use --save-dump-dir DIR, not --save-dump")


def _coverage_fraction(text: str | None) -> float | None:
    """--require-coverage: `full` = 1.0, or a fraction in [0, 1]."""
    if text is None:
        return None
    if text.strip().lower() == "full":
        return 1.0
    try:
        x = float(text)
    except ValueError:
        x = -1.0
    if not 0.0 <= x <= 1.0:
        raise click.BadParameter(f"{text!r} is neither `full` nor a fraction between 0 and 1 (e.g. 0.9)",
                                 param_hint="--require-coverage")
    return x

