"""`kdtr verify --engine python --module pkg.mod:Class`: the skeleton engine of docs/engine-api.md
(examples/numpy_engine.py) passes every committed bundle; a bad --module is one line naming the fix; the
preflight says up front, in one line, when localisation will not work and why."""
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli.main import main
from conformance.engines.user_module import python_engine
from conformance.exit_codes import ExitCode
from conformance.verify.runner import verify
from test_bundles import manifest_commands

ROOT = Path(__file__).resolve().parent.parent
BUNDLES = sorted(manifest_commands())          # the committed bundles (never a git-ignored local slice)
SKELETON = "examples.numpy_engine:NumpyEngine"


@pytest.fixture(autouse=True)
def at_the_root(monkeypatch):
    monkeypatch.chdir(ROOT)          # --module paths are imported with the current directory on sys.path


def test_the_skeleton_engine_passes_every_committed_bundle():
    assert BUNDLES, "no committed bundles found"
    r = CliRunner().invoke(main, ["verify", *BUNDLES, "--engine", "python", "--module", SKELETON])
    assert r.exit_code == 0, r.output[-3000:]
    assert "engine: numpy-skeleton" in r.output and "localisation" not in r.output   # run_layer works
    assert r.output.count("PASS numpy-skeleton") == len(BUNDLES), r.output[-2000:]


@pytest.mark.parametrize("module, code, message", [
    ("examples.numpy_engine:Nope", 2, "examples.numpy_engine has no 'Nope' (its classes: NumpyEngine)"),
    ("no_such_pkg:X", 2, "cannot import 'no_such_pkg' (ModuleNotFoundError"),
    ("examples.numpy_engine:rope", 2, "examples.numpy_engine.rope is a function, not a class"),
    ("examples", 2, "give an import path like 'mypkg.engine:MyEngine'"),
    ("torch_user_models:PortForCausalLM", 2, "PortForCausalLM is a torch.nn.Module (a model, not an engine): "
                                             "run it with --engine torch"),
    ("python_engines:NeedsArguments", 6, "NeedsArguments() raised TypeError"),
    ("python_engines:NoDecode", 6, "NoDecode is not an Engine (docs/engine-api.md): method decode() missing"),
])
def test_a_bad_module_is_one_line_naming_the_fix(module, code, message):
    r = CliRunner().invoke(main, ["verify", BUNDLES[0], "--engine", "python", "--module", module])
    assert r.exit_code == code, r.output
    assert message in " ".join(r.output.split()), r.output


def test_engine_python_needs_a_module_and_takes_no_dtype():
    r = CliRunner().invoke(main, ["verify", BUNDLES[0], "--engine", "python"])
    assert r.exit_code == 2 and "--engine python runs your own engine class: name it with --module" in r.output
    r = CliRunner().invoke(main, ["verify", BUNDLES[0], "--engine", "python", "--module", SKELETON,
                                  "--dtype", "bfloat16"])
    assert r.exit_code == 2 and "declares its own compute dtype" in r.output


def test_a_fault_is_localised_when_run_layer_works(small_bundle):
    said = []
    v = verify(small_bundle, engine=python_engine("python_engines:AttnScaleFault")[0], announce=said.append)
    d = v.first_divergence
    assert said == [] and v.info["localisation"].startswith("ready")
    assert v.exit_code != ExitCode.OK and (d.layer, d.tap, d.cause) == (2, "attn_out", "local"), d


@pytest.mark.parametrize("engine, why", [
    ("python_engines:BrokenRunLayer", "raised AttributeError: 'BrokenRunLayer' object has no attribute 'rotary_emb'"),
    ("python_engines:TupleRunLayer", "returned a tuple, not a dict of taps"),
])
def test_preflight_says_up_front_when_localisation_will_not_work(small_bundle, engine, why):
    """One line before the run (the CLI prints it), and the first divergence says the same, untried."""
    said = []
    v = verify(small_bundle, engine=python_engine(engine)[0], announce=said.append)
    assert len(said) == 1 and said[0].startswith("localisation will not work: run_layer(1, prompt 0's golden "
                                                 "prefill inputs) ") and why in said[0], said
    assert v.first_divergence.cause == f"not localised: {said[0]}"
    assert v.info["localisation"] == said[0]


def test_preflight_line_in_the_cli(small_bundle):
    """The line comes before the verdict, and the first divergence's cause repeats it."""
    r = CliRunner().invoke(main, ["verify", str(small_bundle), "--engine", "python", "--module",
                                  "python_engines:BrokenRunLayer"])
    lines = r.output.splitlines()
    said = [i for i, l in enumerate(lines) if l.startswith("localisation will not work: run_layer(1, ")]
    cause = [i for i, l in enumerate(lines) if l.strip().startswith("cause: not localised: localisation will not")]
    assert r.exit_code in (ExitCode.NUMERIC, ExitCode.TOKENS) and len(said) == 1 and len(cause) == 1, r.output[-2000:]
    assert said[0] < cause[0]
