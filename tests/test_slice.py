"""The real-shape slice (`kdtr gen --preset k26-slice`): the preset keeps K2.6's per-layer shapes and
config values and shrinks only layers, routed experts and vocabulary; the generator stores it as K2.6
ships it (bf16, INT4 experts), records the shrinkage, and the reference engine passes it. CI runs the same
code path on a scaled-down slice (seconds); the real-shape bundle is made only when asked:
`pytest -m k26_slice --k26-slice` (minutes to an hour, bundles/MANIFEST.md)."""
import dataclasses
import hashlib
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

import refmodel.config as config
import refmodel.drafter as drafter
from cli.main import main
from conformance.exit_codes import ExitCode
from conformance.reference_engine import ReferenceEngine
from conformance.runner import verify
from kdtr_format import open_kdtr
from refmodel.config import PRESETS, SLICE_OF, slice_shrinkage

ROOT = Path(__file__).resolve().parent.parent
SLICE = PRESETS["k26-slice"]
K26 = PRESETS["k26"]


def sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def test_slice_keeps_k26_shapes_and_values():
    shrunk = slice_shrinkage("k26-slice")
    assert set(shrunk) == {"num_hidden_layers", "n_routed_experts", "vocab_size"}
    assert SLICE.num_hidden_layers >= SLICE.first_k_dense_replace + 2          # dense first layer + 2 MoE
    assert SLICE.n_routed_experts >= 4 * SLICE.num_experts_per_tok               # top-8 is a real choice
    for f in ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
              "qk_rope_head_dim", "v_head_dim", "intermediate_size", "moe_intermediate_size", "n_shared_experts",
              "routed_scaling_factor", "rope_scaling", "n_group", "num_experts_per_tok", "softmax_scale"):
        assert getattr(SLICE, f) == getattr(K26, f), f
    assert SLICE_OF["k26-slice"] == "k26"


@pytest.fixture
def mini_slice(monkeypatch):
    """A scaled-down stand-in registered as a slice preset: the slice's code path in seconds."""
    mini = dataclasses.replace(PRESETS["tiny"], num_hidden_layers=3, vocab_size=300)
    monkeypatch.setitem(config.PRESETS, "mini-slice", mini)
    monkeypatch.setitem(config.SLICE_OF, "mini-slice", "tiny")
    d = dict(drafter.DRAFTER_PRESETS["k26-slice"], hidden_size=mini.hidden_size, vocab_size=mini.vocab_size,
             mask_token_id=mini.vocab_size - 1, intermediate_size=64)
    monkeypatch.setitem(drafter.DRAFTER_PRESETS, "mini-slice", d)
    return mini


def gen(out, *extra):
    return CliRunner().invoke(main, ["gen", "--preset", "mini-slice", "--num-prompts", "2", "--max-new-tokens",
                                     "6", "--budget", "4", "--distill-steps", "0", *extra, "--out", str(out)])


def test_scaled_down_slice_is_stored_as_k26_ships_and_passes(mini_slice, tmp_path):
    a = tmp_path / "a.kdtr"
    r = gen(a)
    assert r.exit_code == 0, r.output
    first = sha256(a)
    assert gen(a).exit_code == 0 and sha256(a) == first                 # the same command, the same bytes
    with open_kdtr(a, verify=True) as f:
        meta = f.metadata
        assert meta["slice"]["of"] == "tiny" and meta["slice"]["shrunk"] == {
            "num_hidden_layers": {"full": 6, "slice": 3}, "vocab_size": {"full": 400, "slice": 300}}
        dtypes = {n: f.info(n).dtype for n in f.names if not n.startswith(("golden/", "drafter."))}
        assert dtypes["model.layers.1.mlp.experts.0.gate_proj.qw"] == "int32"
        assert dtypes["model.layers.1.mlp.experts.0.gate_proj.sc"] == "bfloat16"
        dense = [n for n in dtypes if not n.endswith((".qw", ".sc"))]
        assert dense and all(dtypes[n] == "bfloat16" for n in dense)
        assert "bf16" in meta["tolerances"]["profiles"]
    v = verify(str(a), engine=ReferenceEngine())
    assert v.exit_code == ExitCode.OK, [(c.name, c.message) for c in v.checks if c.status != "pass"]


def test_recorded_command_reruns_to_the_same_bytes(mini_slice, tmp_path, monkeypatch):
    """The provenance command (every option spelled out) is itself a valid command with the same result."""
    monkeypatch.chdir(tmp_path)
    r = gen("a.kdtr", "--bf16-profile", "no")
    assert r.exit_code == 0, r.output
    with open_kdtr("a.kdtr") as f:
        command = f.metadata["provenance"]["command"]
        assert f.metadata["tolerances"]["profiles"] == {} and "--bf16-profile False" in command
    first = sha256("a.kdtr")
    r = CliRunner().invoke(main, shlex.split(command)[1:])
    assert r.exit_code == 0, r.output
    assert sha256("a.kdtr") == first


def test_slice_options_that_cannot_work_fail_in_one_line(mini_slice, tmp_path):
    r = gen(tmp_path / "x.kdtr", "--quant", "fp32")
    assert r.exit_code == ExitCode.USAGE and "stores its routed experts INT4" in r.output
    r = CliRunner().invoke(main, ["gen", "--preset", "mini-slice", "--out", str(tmp_path / "y.kdtr")])
    assert r.exit_code == ExitCode.USAGE and "pass --distill-steps 0" in r.output


def manifest_slice_command() -> list[str]:
    """The real-shape slice's `kdtr gen` argv from bundles/MANIFEST.md (run under nice there)."""
    for line in (ROOT / "bundles" / "MANIFEST.md").read_text().splitlines():
        if "--preset k26-slice" in line:
            argv = shlex.split(line.strip())
            return argv[argv.index("kdtr") + 1:]
    raise AssertionError("bundles/MANIFEST.md has no k26-slice command")


def manifest_slice_sha256() -> str | None:
    """The slice's recorded sha256, None while MANIFEST.md records none yet."""
    text = (ROOT / "bundles" / "MANIFEST.md").read_text()
    section = text[text.index("k26-slice"):]
    return section.split("sha256: `")[1].split("`")[0] if "sha256: `" in section else None


@pytest.mark.k26_slice
def test_real_shape_slice_regenerates_to_its_manifest_sha256(tmp_path):
    """Only when asked (pytest --k26-slice): the MANIFEST command, its sha256, and the reference passes."""
    argv = manifest_slice_command()
    out = tmp_path / "k26_slice.kdtr"
    argv[argv.index("--out") + 1] = str(out)
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 0, r.output
    got, want = sha256(out), manifest_slice_sha256()
    assert want is not None, f"bundles/MANIFEST.md records no sha256 for the slice yet; this run made {got}"
    assert got == want
    v = verify(str(out), engine=ReferenceEngine())
    assert v.exit_code == ExitCode.OK, [(c.name, c.message) for c in v.checks if c.status != "pass"]
