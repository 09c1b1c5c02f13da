"""bundles/MANIFEST.md's `kdtr gen` commands, read and planned for regeneration (tests/test_bundles.py,
bench/regenerate_bundles.py). Each committed bundle has one command line there, indented, starting `kdtr gen`."""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "bundles" / "MANIFEST.md"


def manifest_commands(path: Path = MANIFEST) -> dict[str, list[str]]:
    """bundle path (as the command's --out names it) -> the `kdtr gen` argv (without `kdtr`), in MANIFEST order."""
    cmds = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line.startswith("kdtr gen "):
            argv = shlex.split(line)[1:]
            cmds[option(argv, "--out")] = argv
    return cmds


def option(argv: list[str], name: str, default: str | None = None) -> str | None:
    """The value of option `name` in a kdtr argv, spelled `name value` or `name=value`; `default` if absent."""
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return default


def with_option(argv: list[str], name: str, value: str) -> list[str]:
    """argv with option `name` set to `value` (either spelling replaced; appended if absent)."""
    out, i, found = [], 0, False
    while i < len(argv):
        a = argv[i]
        if a == name and i + 1 < len(argv):
            out += [name, value]
            i, found = i + 2, True
            continue
        if a.startswith(name + "="):
            out += [name, value]
            i, found = i + 1, True
            continue
        out.append(a)
        i += 1
    return out if found else out + [name, value]


@dataclass
class Job:
    bundle: str             # the committed bundle, as MANIFEST names it
    argv: list[str]         # its command, writing to `out` (and reading a regenerated --model where there is one)
    out: str
    after: str | None       # the bundle whose regeneration this one reads (its --model), if that one is regenerated


def plan(commands: dict[str, list[str]], out_dir: str, only: list[str] | None = None) -> list[Job]:
    """The jobs that regenerate `only` (bundle paths or bare names such as model_tiny; default all) into out_dir,
    in MANIFEST order. A command whose --model is another bundle regenerated in the same run reads the new one and
    runs after it (the INT4 tiny bundle quantizes the FP32 one and copies its drafter); one whose --model is not
    regenerated reads the committed file. Unknown names raise ValueError naming the known ones."""
    names = {Path(b).stem: b for b in commands}
    chosen = list(commands)
    if only:
        unknown = [o for o in only if o not in commands and o not in names]
        if unknown:
            raise ValueError(f"no bundle named {', '.join(unknown)} in bundles/MANIFEST.md; the bundles are "
                             f"{', '.join(names)}")
        wanted = {names.get(o, o) for o in only}
        chosen = [b for b in commands if b in wanted]
    jobs = []
    for b in chosen:
        out = str(Path(out_dir) / Path(b).name)
        argv = with_option(commands[b], "--out", out)
        model = option(argv, "--model")
        after = model if model in chosen else None
        if after:
            argv = with_option(argv, "--model", str(Path(out_dir) / Path(model).name))
        jobs.append(Job(b, argv, out, after))
    return jobs
