"""The repository's layout as docs/architecture.md draws it: imports run one way between the packages and
between conformance/'s sub-packages, no module imports itself back through others, and no conformance/
file is over 350 lines. Every import statement counts, at module level or inside a function."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cli", "conformance", "cuda_engine", "refmodel", "kdtr_format")
# Which top-level packages each may import (besides itself).
MAY_IMPORT = {"cli": {"conformance", "cuda_engine", "refmodel", "kdtr_format"},
              "conformance": {"cuda_engine", "refmodel", "kdtr_format"},
              "cuda_engine": {"refmodel", "kdtr_format"},
              "refmodel": {"kdtr_format"},
              "kdtr_format": set()}
# One module outside a package's allowance: the Engine protocol (its documented argument checks) is for every
# engine to use, kdtr's own CUDA engine too (cuda_engine/engine.py: compact_keep), as a user's engine would;
# it imports no repository module (test below), so no package imports itself back through it.
PROTOCOL = "conformance.engines.protocol"
ANY_ENGINE_MAY_IMPORT = {"cuda_engine": {PROTOCOL}}
# Inside conformance/: the rooms each may import (besides itself); "shared" = the modules at its top.
ROOMS = {"shared": set(), "engines": {"shared"}, "report": {"shared"}, "gen": {"shared"},
         "verify": {"shared", "engines", "report"}}
MAX_CONFORMANCE_LINES = 350


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return mods


def _imports(path: Path, mods: dict) -> set[str]:
    """The repository modules `path` imports (a `from pkg import name` of a submodule counts as that)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in mods}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & mods.keys()
            if node.module in mods and len(subs) < len(node.names):      # names defined in the module itself
                out.add(node.module)
            out |= subs
    return out


GRAPH = {m: _imports(p, _modules()) for m, p in _modules().items()}


def _room(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 2 else "shared"


def test_packages_import_one_way():
    bad = [f"{m} imports {t}" for m, ts in GRAPH.items() for t in ts
           if t.split(".")[0] != m.split(".")[0] and t.split(".")[0] not in MAY_IMPORT[m.split(".")[0]]
           and t not in ANY_ENGINE_MAY_IMPORT.get(m.split(".")[0], ())]
    assert not bad, bad


def test_the_engine_protocol_imports_no_repository_module():
    """What makes the protocol importable by any engine (ANY_ENGINE_MAY_IMPORT) without an import cycle."""
    assert GRAPH[PROTOCOL] == set(), GRAPH[PROTOCOL]


def test_conformance_rooms_import_one_way_and_gen_and_verify_never_each_other():
    bad = [f"{m} imports {t}" for m, ts in GRAPH.items() if m.startswith("conformance") for t in ts
           if t.startswith("conformance.") and _room(t) != _room(m) and _room(t) not in ROOMS[_room(m)]]
    assert not bad, bad


def test_no_module_imports_itself_back():
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = "open"
        for t in sorted(GRAPH[m]):
            if state.get(t) == "open":
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack + [t])
        state[m] = "done"

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_no_conformance_file_is_over_350_lines():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "conformance").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_CONFORMANCE_LINES}
    assert not long, long


def test_the_walk_sees_the_imports_it_must():
    """The graph is not empty by accident: known edges of each kind are in it."""
    assert "conformance.verify.judge_taps" in GRAPH["conformance.verify.judge"]
    assert "conformance.engines.protocol" in GRAPH["conformance.verify.runner"]
    assert "conformance.gen.goldens" in GRAPH["conformance.gen.bf16_profile"]     # a function-level import
    assert "conformance.tolerance" in GRAPH["conformance.gen.goldens"]
