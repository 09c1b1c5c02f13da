"""The walk of one `kdtr verify` run: which of the repository's modules (files) it passes through, in order,
and how often it comes back to a module it had already left (a "re-entry").

    python bench/walk_verify.py [--bundle bundles/model_tiny.kdtr] [--engine reference] [--cli-conformance]
                                [--by-room] [--top 15]

How it is measured: `kdtr verify BUNDLE --engine ENGINE` runs in this process (cli.main, as the installed
`kdtr`), after every module is imported, under sys.setprofile. At each Python call and return event the
"current module" is the file of the innermost frame on the stack that belongs to the repository (cli/,
conformance/, cuda_engine/, refmodel/, kdtr_format/; module-level code, i.e. lazy imports, is skipped, as are
tests/, the venv and the standard library, through which the walk sees the repository frame that called
them). The sequence of current modules, consecutive repeats collapsed to one, is the walk. A re-entry is a
step of the walk onto a module that appeared earlier in it: A B A counts 1, A B C counts 0. The first
figure counts calls into refmodel/ and kdtr_format/ too, so loops over layers and prompts weigh in; with
--cli-conformance only cli/ and conformance/ files are modules (the others are seen through, as the
standard library is). --by-room names each step by its room instead of its file (cli, conformance/verify,
conformance/engines, conformance/report, conformance/gen, conformance's shared modules, cuda_engine,
refmodel, kdtr_format), repeats collapsed again: the back and forth between the folders docs/architecture.md
draws.

Prints the walk's length, the distinct modules, the re-entries, the distinct moves (pairs A -> B of
consecutive steps: how tangled the walk is, whatever the loop counts) and the modules most re-entered.
Deterministic for a given tree (the reference engine's calls do not depend on timing); about 15 s on the
tiny bundle.

Measured (bundles/model_tiny.kdtr, --engine reference), re-entries / distinct moves, before -> after the
verify run moved out of cli/ (conformance/verify/bundles.py):
    all modules               45710 / 176 -> 45712 / 180
    --cli-conformance         19720 / 114 -> 19722 / 118
    --by-room                 21724 / 26  -> 19794 / 20
    --cli-conformance --by-room 8652 / 12 ->  6722 / 8    (cli/ was re-entered 970 times, by the progress
                                                           callback once per check; now it is entered once)
The per-file counts are the judge's per-tap helper calls (judge_taps -> context -> tolerance -> metrics and
back, console -> coverage per check): each a step out and back, 2430 judge_taps <-> context alone.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL = ("cli", "conformance", "cuda_engine", "refmodel", "kdtr_format")
CLI_CONFORMANCE = ("cli", "conformance")


def walk_of(argv: list[str], packages: tuple[str, ...]) -> list[str]:
    """The walk (repository-relative file names, consecutive repeats collapsed) of `kdtr *argv`."""
    from cli.main import main
    prefixes = tuple(os.path.join(ROOT, p) + os.sep for p in packages)
    own: dict = {}                                  # code object -> relative path, or None when not ours

    def ours(code):
        if code not in own:
            f = code.co_filename
            own[code] = os.path.relpath(f, ROOT) if f.startswith(prefixes) and code.co_name != "<module>" else None
        return own[code]

    walk: list[str] = []

    def step(mod):
        if mod is not None and (not walk or walk[-1] != mod):
            walk.append(mod)

    def profile(frame, event, _arg):
        if event == "call":
            step(ours(frame.f_code))
        elif event == "return":
            f = frame.f_back
            while f is not None and ours(f.f_code) is None:
                f = f.f_back
            if f is not None:
                step(ours(f.f_code))

    sys.setprofile(profile)
    try:
        main(argv, standalone_mode=False)
    except SystemExit:
        pass
    finally:
        sys.setprofile(None)
    return walk


def room(path: str) -> str:
    """A module's room: its conformance/ sub-package ("conformance" for the shared modules), else its package."""
    parts = path.split(os.sep)
    return "/".join(parts[:2]) if parts[0] == "conformance" and len(parts) > 2 else parts[0]


def collapsed(steps) -> list[str]:
    return [s for k, s in enumerate(steps) if k == 0 or steps[k - 1] != s]


def reentries(walk: list[str]) -> collections.Counter:
    seen, back = set(), collections.Counter()
    for mod in walk:
        if mod in seen:
            back[mod] += 1
        seen.add(mod)
    return back


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bundle", default="bundles/model_tiny.kdtr")
    ap.add_argument("--engine", default="reference")
    ap.add_argument("--cli-conformance", action="store_true", help="only cli/ and conformance/ files are modules")
    ap.add_argument("--by-room", action="store_true", help="a step is a room (sub-package), not a file")
    ap.add_argument("--top", type=int, default=15, help="how many of the most re-entered modules to list")
    a = ap.parse_args()
    sys.path.insert(0, ROOT)
    import cli.main  # noqa: F401 - every module imported before the trace starts
    walk = walk_of(["verify", a.bundle, "--engine", a.engine], CLI_CONFORMANCE if a.cli_conformance else ALL)
    if a.by_room:
        walk = collapsed([room(m) for m in walk])
    back = reentries(walk)
    edges = set(zip(walk, walk[1:]))
    unit = "rooms" if a.by_room else "modules"
    where = "cli/ + conformance/" if a.cli_conformance else "all"
    print(f"walk of `kdtr verify {a.bundle} --engine {a.engine}` over {where} "
          f"{unit}: {len(walk)} steps, {len(set(walk))} distinct {unit}, {sum(back.values())} re-entries, "
          f"{len(edges)} distinct moves (one -> another)", file=sys.stderr)
    for mod, n in back.most_common(a.top):
        print(f"  {n:8d}  {mod}", file=sys.stderr)


if __name__ == "__main__":
    main()
