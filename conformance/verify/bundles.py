"""`kdtr verify` over its bundles, after the command line is parsed: per bundle, the engine (or the dump),
the run (conformance/verify/runner.py), the console lines, the reports; then the one exit code of them all,
the most severe (README.md: exit codes). cli/verify_cmd.py parses the options into a `Request` and calls
`verify_bundles`."""
from __future__ import annotations

import contextlib
import dataclasses

from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from conformance.engines.engine_choice import EngineOptionError, EngineUnavailable, pick_engine
from conformance.exit_codes import ExitCode
from conformance.precision import ProfileError
from conformance.report.console import print_console, print_verdict
from conformance.report.files import write_reports
from conformance.report.verdict import PRECEDENCE
from conformance.shard_plan import ShardError
from conformance.verify.runner import verify
from conformance.verify.shard_run import ShardedTorchEngine
from kdtr_format.errors import NotARegularFileError
from kdtr_format.paths import check_regular


class RequestError(Exception):
    """The request cannot run as asked (an engine option that does not fit, a profile the bundle lacks):
    a usage error, exit 2, found only once the bundle or the engine is at hand."""


@dataclasses.dataclass(frozen=True)
class Request:
    """What `kdtr verify` was asked, its options already checked against each other (cli/verify_cmd.py).
    outputs: report ("json", "junit", "html", "save_dump") -> one path (or None) per bundle."""
    bundles: list[str]
    outputs: dict[str, list]
    save_dump_dirs: list                  # one per bundle (None: not asked)
    engine: str = "auto"                  # conformance/engines/engine_choice.py names; unused with a dump
    dtype: str | None = None
    module: str | None = None
    w4a16: str | None = None
    ddtree: dict | None = None            # the live DDTree's budget options (pick_engine)
    tp: int | None = None                 # sharded torch run when tp or ep is given
    ep: int | None = None
    dump: str | None = None
    dump_dir: str | None = None
    overrides: tuple = ()
    profile: str | None = None
    require_coverage: float | None = None
    verbose: bool = False

    @property
    def sharded(self) -> bool:
        return self.tp is not None or self.ep is not None


def verify_bundles(req: Request, console, verdicts) -> ExitCode:
    """Run `req` bundle by bundle: engine lines, progress and reports on `console`, each bundle's verdict on
    `verdicts` (stdout unless a report goes there). Returns the most severe exit code; a report not written
    is USAGE, below every failure of the run. Raises RequestError."""
    for path, what in [(b, "bundle") for b in req.bundles] + ([(req.dump, "run dump")] if req.dump else []):
        try:                                        # a FIFO or device: one line and exit 5, before any run
            check_regular(path, what)
        except (NotARegularFileError, OSError) as e:
            console.print(f"kdtr verify: {e}", markup=False, highlight=False, soft_wrap=True)
            return ExitCode.INVALID_FILE
    worst = ExitCode.OK
    for k, bundle in enumerate(req.bundles):
        engine = None
        if req.sharded:
            try:
                engine = ShardedTorchEngine(req.tp or 1, req.ep or 1)
            except ShardError as e:
                raise RequestError(str(e)) from None
            console.print(f"engine: [bold]torch[/bold] ({escape(engine.describe())})")
        elif not (req.dump or req.dump_dir):
            try:
                engine, why = pick_engine(req.engine, req.dtype, req.module, req.w4a16, req.ddtree)
            except EngineOptionError as e:
                raise RequestError(str(e)) from None
            except EngineUnavailable as e:
                console.print(f"[red]kdtr verify: {escape(str(e))}[/red]", soft_wrap=True)
                return ExitCode.ENGINE_ERROR
            console.print(f"engine: [bold]{escape(engine.name)}[/bold] ({escape(why)})")
        with _bars(console, bundle) as progress:
            try:
                v = verify(bundle, engine=engine, dump=req.dump, overrides=req.overrides, progress=progress,
                           save_dump=req.outputs["save_dump"][k], require_coverage=req.require_coverage,
                           profile=req.profile, announce=lambda line: console.print(escape(line), soft_wrap=True),
                           dump_dir=req.dump_dir, save_dump_dir=req.save_dump_dirs[k])
            except ProfileError as e:
                raise RequestError(f"{bundle}: {e}") from None
        console.print(f"tolerance profile: {v.info.get('profile', '-')}")
        if "routing" in v.info:
            console.print(f"routing: {escape(v.info['routing'])}")
        if "shard" in v.info:
            sh = v.info["shard"]
            console.print(f"ranks: {sh['world_size']} (tp {sh['tp']}, ep {sh['ep']}); replicated records: "
                          f"{escape(sh['replicated_copies'])}")
        print_console(v, verdicts, verbose=req.verbose, verdict=False)
        failed = write_reports(v, {r: ps[k] for r, ps in req.outputs.items()}, console)
        print_verdict(v, verdicts, failed)
        worst = max(worst, ExitCode.USAGE if failed and v.exit_code == ExitCode.OK else v.exit_code, key=_severity)
    return worst


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


def _severity(code: ExitCode) -> int:
    """PRECEDENCE, then USAGE (a report not written) below every failure of the run, then OK."""
    if code in PRECEDENCE:
        return len(PRECEDENCE) - PRECEDENCE.index(code) + 1
    return 1 if code == ExitCode.USAGE else 0
