"""`kdtr verify`: judge an engine (or an external engine's run dump) against golden bundles."""
from __future__ import annotations

import contextlib
import sys

import click
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from cli.inputs import InputPath
from cli.outputs import (STDOUT, check_output, make_console, per_bundle, refuse_overwriting, write_error,
                         writes_stdout)
from conformance.engines.engine_choice import ENGINES, EngineOptionError, EngineUnavailable, pick_engine
from conformance.exit_codes import ExitCode
from conformance.precision import PROFILES, ProfileError
from conformance.report.console import print_console, print_verdict
from conformance.report.html import write_html
from conformance.report.verdict import PRECEDENCE, write_json, write_junit
from conformance.rules_file import load_rules_file
from conformance.verify.runner import verify
from conformance.shard_plan import ShardError
from conformance.verify.shard_run import ShardedTorchEngine
from cuda_engine.engine import W4A16_MODES
from kdtr_format.errors import NotARegularFileError
from kdtr_format.paths import check_regular, same_file


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
def verify_cmd(bundles, engine_name, dtype, module_path, w4a16, profile, dump, dump_dir, tp, ep, save_dump_dir, rules,
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
    to_stdout = _stdout_report(reports, len(bundles))
    paths = {hint: per_bundle(path, list(bundles)) for hint, path in (*reports.items(), ("--save-dump", save_dump))}
    rank_dirs = per_bundle(save_dump_dir, list(bundles))
    _refuse_repeats(bundles)
    refuse_overwriting([(hint, p) for hint, ps in paths.items() for p in dict.fromkeys(ps)],
                       [("bundle", b) for b in bundles] + [("run dump", dump), ("rules file", rules)])
    for path, what in [(b, "bundle") for b in bundles] + ([(dump, "run dump")] if dump else []):
        try:                                        # a FIFO or device: one line and exit 5, before any run
            check_regular(path, what)
        except (NotARegularFileError, OSError) as e:
            make_console(stderr=True).print(f"kdtr verify: {e}", markup=False, highlight=False, soft_wrap=True)
            sys.exit(ExitCode.INVALID_FILE)
    verdicts = make_console(stderr=to_stdout)      # the console's own lines: stdout, unless a report takes it
    worst = ExitCode.OK
    for k, bundle in enumerate(bundles):
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
        with _bars(console, bundle) as progress:
            try:
                v = verify(bundle, engine=engine, dump=dump, overrides=overrides, progress=progress,
                           save_dump=paths["--save-dump"][k], require_coverage=coverage, profile=profile,
                           announce=lambda line: console.print(escape(line), soft_wrap=True), dump_dir=dump_dir,
                           save_dump_dir=rank_dirs[k])
            except ProfileError as e:
                raise click.UsageError(f"{bundle}: {e}") from None
        console.print(f"tolerance profile: {v.info.get('profile', '-')}")
        if "routing" in v.info:
            console.print(f"routing: {escape(v.info['routing'])}")
        if "shard" in v.info:
            sh = v.info["shard"]
            console.print(f"ranks: {sh['world_size']} (tp {sh['tp']}, ep {sh['ep']}); replicated records: "
                          f"{escape(sh['replicated_copies'])}")
        print_console(v, verdicts, verbose=verbose, verdict=False)
        failed = _write_reports(v, {h: ps[k] for h, ps in paths.items()}, console)
        print_verdict(v, verdicts, failed)
        worst = max(worst, ExitCode.USAGE if failed and v.exit_code == ExitCode.OK else v.exit_code, key=_severity)
    sys.exit(int(worst))


REPORTS = (("--json", "JSON report", write_json), ("--junit", "JUnit report", write_junit),
           ("--html", "HTML report", write_html))


def _write_reports(v, paths: dict, console) -> list[str]:
    """Write every report asked for, each on its own: one that fails (a full disk) is named with why, and
    the others are still written. Returns the paths not written (the run dump's included)."""
    failed = []
    saved = v.info.get("save_dump")
    if paths["--save-dump"] and saved is None:
        console.print(Text(f"run dump not written to {paths['--save-dump']}: the run stopped before the engine's "
                           f"outputs were complete (see above)", style="yellow"), soft_wrap=True)
    elif saved is not None and "error" in saved:
        failed.append(saved["path"])
        console.print(Text(f"run dump NOT written: cannot write {saved['path']}: {saved['error']}", style="bold red"),
                      soft_wrap=True)
    elif saved is not None:
        console.print(Text(f"run dump: {saved['path']}"), soft_wrap=True)
    for hint, label, write in REPORTS:
        path = paths[hint]
        if path is None:
            continue
        try:
            write(v, "/dev/stdout" if path == STDOUT else path)
        except OSError as e:       # e.g. a full disk: named, and the next report is still tried
            failed.append(path)
            console.print(Text(f"{label} NOT written: {write_error(e, path)}", style="bold red"), soft_wrap=True)
            continue
        console.print(Text(f"{label}: {'stdout' if path == STDOUT else path}"), soft_wrap=True)
    return failed


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


@contextlib.contextmanager
def _bars(console, bundle: str):
    """A progress(stage, done, total, info) callback drawing a transient bar per stage (terminals only)."""
    cols = (TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, console=console, transient=True) as bar:
        task = {}

        def progress(stage, done, total, _info):
            if stage not in task:
                task[stage] = bar.add_task(f"{bundle}: {stage}", total=total)
            bar.update(task[stage], completed=done)
        yield progress


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
    """PRECEDENCE, then USAGE (a report not written) below every failure of the run, then OK."""
    if code in PRECEDENCE:
        return len(PRECEDENCE) - PRECEDENCE.index(code) + 1
    return 1 if code == ExitCode.USAGE else 0
