"""The real-shape slice (`kdtr gen --preset k26-slice`): the preset keeps K2.6's per-layer shapes and
config values and shrinks only layers, routed experts and vocabulary; the generator stores it as K2.6
ships it (bf16, INT4 experts), records the shrinkage, and the reference engine passes it. CI runs the same
code path on a scaled-down slice (seconds); the real-shape bundle is made only when asked:
`pytest -m k26_slice --k26-slice` (minutes to an hour, bundles/MANIFEST.md)."""
import dataclasses
import hashlib
import json
import shlex
from pathlib import Path

from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

import refmodel.config as config
import refmodel.drafter as drafter
from cli.main import main
from conformance.engines.reference_engine import ReferenceEngine
from conformance.exit_codes import ExitCode
from conformance.gen.goldens import PromptGoldens, check_decisive, routing_near_tie_count
from conformance.tolerance import DerivedTolerance
from conformance.verify.runner import verify
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
    want = json.loads((ROOT / "bundles" / "k26_slice.tensors.json").read_text())   # name -> sha256
    with open_kdtr(out, verify=True) as f:
        got = {n: f.info(n).checksum for n in f.names}
    assert got == want          # every tensor; the file's own sha256 also depends on the recorded Python/NumPy
    if manifest_slice_sha256() != sha256(out):
        print(f"file sha256 {sha256(out)} differs from the MANIFEST's (the provenance metadata: Python, NumPy)")
    v = verify(str(out), engine=ReferenceEngine())
    assert v.exit_code == ExitCode.OK, [(c.name, c.message) for c in v.checks if c.status != "pass"]


def test_held_routing_bundle_records_its_rule_and_near_ties(mini_slice, tmp_path):
    """--routing-near-ties held: the manifest says so, the near-tie count matches the stored scores, and the
    default (forbid) writes neither key, so bundles made without the option are unchanged."""
    a, b = tmp_path / "held.kdtr", tmp_path / "forbid.kdtr"
    r = gen(a, "--bf16-profile", "no", "--routing-near-ties", "held", "--seed", "1", "--num-prompts", "4",
            "--max-new-tokens", "12")                # this seed's prompts have a routing near-tie
    assert r.exit_code == 0, r.output
    assert gen(b, "--bf16-profile", "no").exit_code == 0
    with open_kdtr(b) as f:
        assert "routing" not in f.metadata["tolerances"] and "routing_near_ties" not in f.metadata["figures"]
        assert "--routing-near-ties" not in f.metadata["provenance"]["command"]
    with open_kdtr(a) as f:
        man, cfg = f.metadata["tolerances"], mini_slice
        assert man["routing"] == "held" and "--routing-near-ties held" in f.metadata["provenance"]["command"]
        reach = 4 * max(DerivedTolerance.from_dict(e).rule().atol for k, e in man["taps"].items()
                        if k.endswith("/router_scores"))
        K, want = cfg.num_experts_per_tok, 0
        for i in range(f.metadata["prompts"]):
            for l in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
                bias = np.asarray(f.get(f"model.layers.{l}.mlp.gate.e_score_correction_bias"), np.float64)
                for phase in ("prefill", "ar"):
                    s = np.asarray(f.get(f"golden/p{i}/{phase}/L{l}/router_scores"), np.float64) + bias
                    part = np.partition(s, s.shape[-1] - K - 1, axis=-1)[:, s.shape[-1] - K - 1:]  # top K+1
                    kth, next_ = np.sort(part, axis=-1)[:, 1], np.sort(part, axis=-1)[:, 0]
                    want += int(np.sum(kth - next_ < reach))
        assert want > 0 and f.metadata["figures"]["routing_near_ties"] == want


def test_routing_near_tie_count_counts_gaps_under_four_router_atols(mini_slice):
    """Built scores: row gaps (K-th minus (K+1)-th biased score) of 0, 3.9, 4.1 and 10 router atols."""
    cfg, atol = mini_slice, 1e-3
    E, K, L = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.first_k_dense_replace
    bias = np.linspace(-0.01, 0.01, E)
    W64 = {f"model.layers.{l}.mlp.gate.e_score_correction_bias": bias for l in range(cfg.num_hidden_layers)}
    base = np.arange(E, 0, -1) * 1.0                      # descending, gaps of 1 between neighbours
    rows = []
    for g in (0.0, 3.9, 4.1, 10.0):
        r = base.copy()
        r[K] = r[K - 1] - g * atol                        # the (K+1)-th sits g atols under the K-th
        rows.append(r - bias)                             # stored unbiased: the count adds the bias back
    scores = np.array(rows)
    g64 = {f"prefill/L{l}/router_scores": scores for l in range(L, cfg.num_hidden_layers)}
    g64.update({f"ar/L{l}/router_scores": scores[:1] for l in range(L, cfg.num_hidden_layers)})
    pg = SimpleNamespace(g64=g64)
    moe = cfg.num_hidden_layers - L
    assert routing_near_tie_count(cfg, W64, [pg], atol) == moe * (2 + 1)        # 0 and 3.9 (+ decode's 0)


def test_held_routing_keeps_prompts_that_forbid_rejects():
    """check_decisive: a routing gap under 4x the router atol rejects a prompt unless routing is held."""
    pg = PromptGoldens(prompt=np.array([1]), tokens=np.array([3, 4]), margins=np.array([1.0, 1.0]),
                       routing_gap=1e-6, g64={}, errors={"prefill/L1/topk_ids": {"mismatches": 1}},
                       ddtree=SimpleNamespace(tokens=[3, 4]))
    assert "from a tie" in check_decisive(pg, 1e-3, 1e-5)
    assert check_decisive(pg, 1e-3, 1e-5, routing_held=True) is None
    pg.routing_gap = 1.0
    assert "already picks other experts" in check_decisive(pg, 1e-3, 1e-5)
    assert check_decisive(pg, 1e-3, 1e-5, routing_held=True) is None
    pg.margins = np.array([1.0, 1e-6])                                     # token margins stay decisive
    assert "margin" in check_decisive(pg, 1e-3, 1e-5, routing_held=True)


def test_gen_bytes_do_not_depend_on_upcasting_once_or_per_matmul(mini_slice, tmp_path, monkeypatch):
    """`kdtr gen` upcasts the model once where memory allows (refmodel.stored.upcast_if_fits), else per
    matmul: the same bytes either way, so the path a machine takes never changes a bundle."""
    import conformance.gen.gen as gen_mod
    import refmodel.stored as stored
    took = []

    class Runs(gen_mod._GoldenRuns):                 # which weights the golden runs got
        def __init__(self, m, W64, *a, **kw):
            took.append(type(W64).__name__)
            super().__init__(m, W64, *a, **kw)

    monkeypatch.setattr(gen_mod, "_GoldenRuns", Runs)
    shas = []
    for avail in (0, 1 << 50):                       # nothing available: per matmul; plenty: once
        monkeypatch.setattr(stored, "available_memory", lambda avail=avail: avail)
        out = tmp_path / "s.kdtr"                    # one path: the command recorded in the bundle names it
        r = gen(out, "--bf16-profile", "no", "--routing-near-ties", "held")
        assert r.exit_code == 0, r.output
        shas.append(sha256(out))
        out.unlink()
    assert took == ["StoredWeights", "dict"]
    assert shas[0] == shas[1]


def test_gen_bytes_do_not_depend_on_forked_prompt_jobs(mini_slice, tmp_path, monkeypatch):
    """On a machine with CORES_PER_JOB cores per prompt, the prompts' golden runs go to forked workers:
    the same bytes as one after the other."""
    import conformance.gen.gen as gen_mod
    pools = []

    class Pool(gen_mod.ProcessPoolExecutor):
        def __init__(self, jobs, **kw):
            pools.append(jobs)
            super().__init__(jobs, **kw)

    monkeypatch.setattr(gen_mod, "ProcessPoolExecutor", Pool)
    shas = []
    for cores in (1, 64):
        monkeypatch.setattr(gen_mod.os, "cpu_count", lambda cores=cores: cores)
        out = tmp_path / "s.kdtr"
        r = gen(out, "--bf16-profile", "no", "--num-prompts", "3")
        assert r.exit_code == 0, r.output
        shas.append(sha256(out))
        out.unlink()
    assert pools == [4]                      # 3 prompts + the long-position one, forked only with 64 cores
    assert shas[0] == shas[1]


def test_a_failed_worker_is_a_one_line_gen_error(mini_slice, tmp_path, monkeypatch):
    """A forked golden run that dies (here: out of memory) ends gen with a usage-style error naming the prompt
    and what to change, not a traceback."""
    import conformance.gen.gen as gen_mod
    monkeypatch.setattr(gen_mod.os, "cpu_count", lambda: 64)

    def oom(*args, **kwargs):                        # runs in the forked worker (fork copies the patch)
        raise MemoryError("no memory for the float32 copy")

    monkeypatch.setattr(gen_mod, "golden_for_prompt", oom)
    r = gen(tmp_path / "s.kdtr", "--bf16-profile", "no")
    assert r.exit_code == ExitCode.USAGE, r.output
    assert "in a worker process failed (MemoryError" in r.output and "CORES_PER_JOB" in r.output
    assert not (tmp_path / "s.kdtr").exists()
