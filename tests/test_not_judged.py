"""Nothing counted as judged that the engine did not compute (conformance/verify/not_judged.py).

Under `--engine torch --module`, a port with `kdtr_int4_packed = True` decodes the INT4 experts itself and
one whose cache class has `compact(start, keep)` compacts its own cache, so their faults are caught: the
nibble order reversed at the first MoE layer's `mlp_out`, a compaction that forgets `start` at the DDTree
replay. A port that leaves both to kdtr passes, with the two steps listed under "done by kdtr, not judged"
in every report and their checks out of coverage (so `--require-coverage full` fails). On the committed
INT4 bundle (a torch verify takes ~15 s here).
"""
import json

import pytest
from click.testing import CliRunner

from cli.main import main
from conformance.engines.torch_engine import TorchEngine
from conformance.exit_codes import ExitCode
from conformance.verify.runner import verify
from kdtr_format import open_kdtr

BUNDLE = "bundles/model_int4_tiny.kdtr"
USER = "torch_user_models:"


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """As tests/test_torch_engine.py: the tiny model's ops are too small for torch's thread pool."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def port(name: str, **kw):
    return verify(BUNDLE, engine=TorchEngine("float32", module=USER + name), **kw)


def first_moe_layer() -> int:
    with open_kdtr(BUNDLE) as f:
        return f.metadata["model_config"]["first_k_dense_replace"]


def failed(v) -> list[str]:
    return [c.name for c in v.checks if c.status in ("fail", "error")]


def status(v) -> dict:
    return {c.name: c.status for c in v.checks}


def test_a_correct_port_that_decodes_int4_and_compacts_its_own_cache_passes():
    v = port("PackedInt4PortForCausalLM")
    assert v.exit_code == ExitCode.OK, failed(v)[:5]
    assert [d["step"] for d in v.done_by_kdtr] == ["ddtree_loop"]       # the torch engine has no own loop
    st, l = status(v), first_moe_layer()
    assert st[f"p0/prefill/L{l}/mlp_out"] == "pass" and st["p0/ddtree/rounds"] == "pass"   # judged, its own
    assert {n.split("/")[1] for n, s in st.items() if s == "skip"} == {"ddtree_live"}


def test_int4_nibbles_reversed_fail_at_the_first_moe_layers_mlp_out():
    v = port("ReversedNibblesForCausalLM")
    assert v.exit_code in (ExitCode.NUMERIC, ExitCode.TOKENS), failed(v)[:5]
    l = first_moe_layer()
    assert v.first_divergence.name == f"p0/prefill/L{l}/mlp_out", v.first_divergence
    assert v.first_divergence.cause == "local"
    assert all(s == "pass" for n, s in status(v).items() if n.startswith(f"p0/prefill/L{l}/") and
               not n.endswith(("mlp_out", "resid_out")))                # everything before the experts is right


def test_a_cache_compaction_that_forgets_start_fails_the_ddtree_checks():
    v = port("StartlessCompactionForCausalLM")
    assert v.exit_code == ExitCode.DDTREE, failed(v)[:5]
    bad = failed(v)
    assert any(n.endswith("/ddtree/rounds") for n in bad)
    assert all("/ddtree/" in n or n.endswith("/long_position") for n in bad), bad   # taps and AR all pass


def test_steps_kdtr_performs_are_listed_in_every_report_and_not_covered(tmp_path):
    """The same correct port leaving INT4 decoding and compaction to kdtr: it passes, but the reports list
    both steps under "done by kdtr, not judged", their passing checks are skipped, and full coverage fails."""
    r = CliRunner().invoke(main, ["verify", BUNDLE, "--engine", "torch", "--module", USER + "Float64RopePortForCausalLM",
                                  "--json", str(tmp_path / "r.json"), "--junit", str(tmp_path / "r.xml"),
                                  "--html", str(tmp_path / "r.html")])
    assert r.exit_code == 0, r.output[-3000:]
    rep = json.loads((tmp_path / "r.json").read_text())
    steps = {d["step"]: d for d in rep["done_by_kdtr"]}
    assert set(steps) == {"int4_decode", "cache_compaction", "ddtree_loop"}
    assert "does not set kdtr_int4_packed = True" in steps["int4_decode"]["why"]
    checks = {c["name"]: c for c in rep["checks"]}
    l = first_moe_layer()
    moe = checks[f"p0/prefill/L{l}/mlp_out"]
    assert moe["status"] == "skip" and moe["message"].startswith("done by kdtr, not judged: INT4 decoding")
    assert checks[f"p0/prefill/L{l - 1}/mlp_out"]["status"] == "pass"   # a dense layer: the engine's own
    assert checks["p0/ddtree/rounds"]["status"] == "skip"
    assert rep["coverage"]["ddtree"]["run"] == 0
    assert "done by kdtr, not judged: INT4 decoding of the weights" in r.output
    assert 'name="done_by_kdtr.int4_decode"' in (tmp_path / "r.xml").read_text()
    assert "Done by kdtr, not judged" in (tmp_path / "r.html").read_text()
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("PASS torch on") and "checks ran" in last, last  # never a plain PASS
    r = CliRunner().invoke(main, ["verify", BUNDLE, "--engine", "torch", "--module", USER + "Float64RopePortForCausalLM",
                                  "--require-coverage", "full"])
    assert r.exit_code == ExitCode.COVERAGE, r.output[-2000:]
    assert "INT4 decoding of the weights done by kdtr, not judged" in r.output
