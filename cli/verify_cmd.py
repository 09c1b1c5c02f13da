"""`kdtr verify`: judge an engine (or an external engine's run dump) against golden bundles."""
from __future__ import annotations

import sys

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cli.outputs import check_output, fail_write
from conformance.engines.engine_choice import ENGINES, EngineOptionError, EngineUnavailable, pick_engine
from conformance.exit_codes import ExitCode
from conformance.report.console import print_console
from conformance.precision import PROFILES, ProfileError
from conformance.report.verdict import PRECEDENCE, write_html, write_json, write_junit
from conformance.verify.runner import verify
from conformance.verify.shard_run import ShardedTorchEngine
from conformance.shard_plan import ShardError
from conformance.tolerance import load_rules_file
from cuda_engine.engine import W4A16_MODES
from kdtr_format.errors import NotARegularFileError
from kdtr_format.paths import check_regular


def _suffixed(path: str | None, bundle: str, many: bool) -> str | None:
    """With several bundles, one report per bundle: report.json -> report.model_tiny.json."""
    if path is None or not many:
        return path
    stem = bundle.rsplit("/", 1)[-1].rsplit(".", 1)[0]
    head, dot, ext = path.rpartition(".")
    return f"{head}.{stem}.{ext}" if dot else f"{path}.{stem}"


@click.command("verify")
@click.argument("bundles", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--engine", "engine_name", type=click.Choice(["auto"] + sorted(ENGINES)), default="auto",
              show_default=True, help="Engine under test; auto = cuda when a GPU and pycuda are present, "
                                      "else reference; torch = a PyTorch DeepseekV3 (docs/conformance.md).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]),
              help="--engine torch: compute dtype (default float32).")
@click.option("--module", "module_path", metavar="PKG.MOD:CLASS",
              help="--engine torch: your own DeepseekV3 port (HF parameter names) instead of transformers'.")
@click.option("--w4a16", type=click.Choice(W4A16_MODES),
              help="--engine cuda: INT4 expert kernels: fast (tensor cores, FP32-faithful; the default), plain "
                   "(the packed weights as stored), dense (dequantized at load). docs/cuda-engine.md.")
@click.option("--profile", type=click.Choice(PROFILES),
              help="Tolerance profile the bundle derived (fp32, bf16); default: the engine's dtype.")
@click.option("--dump", type=click.Path(exists=True, dir_okay=False),
              help="Judge an external engine's run dump (docs/run-dump.md) instead of running an engine (so "
                   "--engine, --dtype, --module and --w4a16 do not apply: a usage error).")
@click.option("--dump-dir", type=click.Path(exists=True, file_okay=False),
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
@click.option("--rules", type=click.Path(exists=True, dir_okay=False),
              help="Tolerance overrides: TOML/JSON, glob over check names -> rule (docs/conformance.md).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the JSON report here.")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False), help="Write a JUnit XML report here.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False), help="Write a static HTML report here.")
@click.option("--save-dump", type=click.Path(dir_okay=False),
              help="Also write the engine's outputs as a run dump (the format external engines write).")
@click.option("--require-coverage", "require_coverage", metavar="full|FRACTION",
              help="Fail (exit 7) unless every group of checks (prefill, decode, tokens, ddtree) ran at "
                   "least this fraction of the checks the bundle defines; `full` = 1. Default: skipped "
                   "taps are allowed, and reported.")
@click.option("-v", "--verbose", is_flag=True, help="List every check, not only failures.")
def verify_cmd(bundles, engine_name, dtype, module_path, w4a16, profile, dump, dump_dir, tp, ep, save_dump_dir, rules,
               json_path, junit_path, html_path, save_dump, require_coverage, verbose):
    """Verify an engine against golden BUNDLES: every tap of every layer, the AR token stream and
    the DDTree rounds. Exit 0 pass, 1 numeric, 2 usage, 3 tokens, 4 DDTree, 5 invalid/corrupt bundle or
    dump, 6 engine error, 7 coverage below --require-coverage (the most severe wins when several occur:
    5 > 6 > 3 > 4 > 1 > 7).
    """
    console = Console(stderr=True)
    coverage = _coverage_fraction(require_coverage)
    try:
        overrides = load_rules_file(rules) if rules else ()
    except (OSError, ValueError) as e:
        raise click.BadParameter(str(e), param_hint="--rules") from None
    for path, hint in ((json_path, "--json"), (junit_path, "--junit"), (html_path, "--html")):
        check_output(path, hint, stream_ok=True)    # a report may go to a device or /dev/stdout
    check_output(save_dump, "--save-dump")          # a .kdtr needs a regular file (it is seeked)
    if dump and len(bundles) > 1:
        raise click.UsageError("--dump judges one run against one bundle: pass a single BUNDLE")
    if dump and dump_dir:
        raise click.UsageError("--dump judges one run dump, --dump-dir a sharded run's rank dumps: pass one of them")
    if dump or dump_dir:
        _refuse_engine_options(engine_name, dtype, module_path, w4a16, tp, ep, "--dump" if dump else "--dump-dir")
    if dump_dir and len(bundles) > 1:
        raise click.UsageError("--dump-dir judges one run against one bundle: pass a single BUNDLE")
    if dump_dir and (save_dump or save_dump_dir):
        raise click.UsageError("--dump-dir judges rank dumps already written: drop --save-dump/--save-dump-dir")
    sharded = tp is not None or ep is not None
    if sharded:
        _check_sharded_options(engine_name, dtype, module_path, save_dump)
    elif save_dump_dir:
        raise click.UsageError("--save-dump-dir keeps a sharded run's rank dumps: give --tp or --ep (else --save-dump)")
    for path, what in [(b, "bundle") for b in bundles] + ([(dump, "run dump")] if dump else []):
        try:                                        # a FIFO or device: one line and exit 5, before any run
            check_regular(path, what)
        except (NotARegularFileError, OSError) as e:
            Console(stderr=True, soft_wrap=True).print(f"kdtr verify: {e}", markup=False, highlight=False)
            sys.exit(ExitCode.INVALID_FILE)
    worst = ExitCode.OK
    for bundle in bundles:
        engine = None
        if sharded:
            try:
                engine = ShardedTorchEngine(tp or 1, ep or 1)
            except ShardError as e:
                raise click.UsageError(str(e)) from None
            console.print(f"engine: [bold]torch[/bold] ({escape(engine.describe())})")
        elif not (dump or dump_dir):
            try:
                engine, why = pick_engine(engine_name, dtype, module_path, w4a16)
            except EngineOptionError as e:
                raise click.UsageError(str(e)) from None
            except EngineUnavailable as e:
                console.print(f"[red]kdtr verify: {escape(str(e))}[/red]", soft_wrap=True)
                sys.exit(ExitCode.ENGINE_ERROR)
            console.print(f"engine: [bold]{escape(engine.name)}[/bold] ({escape(why)})")
        cols = (TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn())
        with Progress(*cols, console=console, transient=True) as bar:
            task = {}

            def progress(stage, done, total, _info):
                if stage not in task:
                    task[stage] = bar.add_task(f"{bundle}: {stage}", total=total)
                bar.update(task[stage], completed=done)

            try:
                v = verify(bundle, engine=engine, dump=dump, overrides=overrides, progress=progress,
                           save_dump=_suffixed(save_dump, bundle, len(bundles) > 1), require_coverage=coverage,
                           profile=profile, dump_dir=dump_dir,
                           save_dump_dir=_suffixed(save_dump_dir, bundle, len(bundles) > 1))
            except ProfileError as e:
                raise click.UsageError(f"{bundle}: {e}") from None
            except OSError as e:        # only the dump write touches the file system after the checks above
                if not save_dump:
                    raise
                fail_write(e, "kdtr verify --save-dump")
        console.print(f"tolerance profile: {v.info.get('profile', '-')}")
        if "routing" in v.info:
            console.print(f"routing: {escape(v.info['routing'])}")
        if "shard" in v.info:
            sh = v.info["shard"]
            console.print(f"ranks: {sh['world_size']} (tp {sh['tp']}, ep {sh['ep']}); replicated records: "
                          f"{escape(sh['replicated_copies'])}")
        print_console(v, Console(), verbose=verbose)
        many = len(bundles) > 1
        for path, write in ((json_path, write_json), (junit_path, write_junit), (html_path, write_html)):
            if path:
                try:
                    write(v, _suffixed(path, bundle, many))
                except OSError as e:   # e.g. --json /dev/full: one line and exit 2, the device untouched
                    fail_write(e, "kdtr verify")
        worst = max(worst, v.exit_code, key=_severity)
    sys.exit(int(worst))


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


def _severity(code: ExitCode) -> int:
    return len(PRECEDENCE) - PRECEDENCE.index(code) if code in PRECEDENCE else 0
