"""Writing the reports one verify run was asked for (JSON, JUnit, HTML) and naming the run dump it saved:
each report on its own, so one that fails (a full disk) is named with why and the others are still written.
A failed write is one line naming the file, never a traceback."""
from __future__ import annotations

from rich.text import Text

from conformance.report.html import write_html
from conformance.report.verdict import write_json, write_junit
from kdtr_format.paths import OutputPathError

STDOUT = "-"       # a report path meaning standard output

# (report, what the console calls it, its writer), in the order they are written.
REPORTS = (("json", "JSON report", write_json), ("junit", "JUnit report", write_junit),
           ("html", "HTML report", write_html))


def write_reports(v, paths: dict, console) -> list[str]:
    """Write every report asked for (paths: report -> path or None, "save_dump" the run dump's) and say
    where each went. Returns the paths not written (the run dump's included)."""
    failed = []
    saved = v.info.get("save_dump")
    if paths["save_dump"] and saved is None:
        console.print(Text(f"run dump not written to {paths['save_dump']}: the run stopped before the engine's "
                           f"outputs were complete (see above)", style="yellow"), soft_wrap=True)
    elif saved is not None and "error" in saved:
        failed.append(saved["path"])
        console.print(Text(f"run dump NOT written: cannot write {saved['path']}: {saved['error']}", style="bold red"),
                      soft_wrap=True)
    elif saved is not None:
        console.print(Text(f"run dump: {saved['path']}"), soft_wrap=True)
    for report, label, write in REPORTS:
        path = paths[report]
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


def write_error(err: OSError, path: str | None = None) -> str:
    """One line for a failed write, naming the file."""
    if isinstance(err, OutputPathError):
        return str(err)
    name = err.filename or path
    return f"cannot write {name}: {err.strerror or err}" if name else f"cannot write: {err}"
