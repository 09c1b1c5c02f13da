"""The walk of one `kdtr verify` run: which of the repository's modules (files) it passes through, in order,
and how often it comes back to a module it had already left (a "re-entry").

    python bench/walk_verify.py [--bundle bundles/model_tiny.kdtr] [--engine reference] [--rooms] [--top 15]

How it is measured: `kdtr verify BUNDLE --engine ENGINE` runs in this process (cli.main, as the installed
`kdtr`), after every module is imported, under sys.setprofile. At each Python call and return event the
"current module" is the file of the innermost frame on the stack that belongs to the repository (cli/,
conformance/, cuda_engine/, refmodel/, kdtr_format/; module-level code, i.e. lazy imports, is skipped, as are
tests/, the venv and the standard library, through which the walk sees the repository frame that called
them). The sequence of current modules, consecutive repeats collapsed to one, is the walk. A re-entry is a
step of the walk onto a module that appeared earlier in it: A B A counts 1, A B C counts 0. The first
figure counts calls into refmodel/ and kdtr_format/ too, so loops over layers and prompts weigh in; with
--rooms only cli/ and conformance/ files are modules (the others are seen through, as the standard library
is), which is the walk between the conformance rooms that docs/architecture.md draws.

Prints the walk's length, the distinct modules, the re-entries, the distinct moves (pairs A -> B of
consecutive steps: how tangled the walk is, whatever the loop counts) and the modules most re-entered. Deterministic
for a given tree (the reference engine's calls do not depend on timing); about a minute on the tiny bundle.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL = ("cli", "conformance", "cuda_engine", "refmodel", "kdtr_format")
ROOMS = ("cli", "conformance")


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
    ap.add_argument("--rooms", action="store_true", help="only cli/ and conformance/ files count as modules")
    ap.add_argument("--top", type=int, default=15, help="how many of the most re-entered modules to list")
    a = ap.parse_args()
    sys.path.insert(0, ROOT)
    import cli.main  # noqa: F401 - every module imported before the trace starts
    walk = walk_of(["verify", a.bundle, "--engine", a.engine], ROOMS if a.rooms else ALL)
    back = reentries(walk)
    edges = set(zip(walk, walk[1:]))
    print(f"walk of `kdtr verify {a.bundle} --engine {a.engine}` over {'cli/ + conformance/' if a.rooms else 'all'}"
          f" modules: {len(walk)} steps, {len(set(walk))} distinct modules, {sum(back.values())} re-entries, "
          f"{len(edges)} distinct moves (module -> module)", file=sys.stderr)
    for mod, n in back.most_common(a.top):
        print(f"  {n:8d}  {mod}", file=sys.stderr)


if __name__ == "__main__":
    main()
