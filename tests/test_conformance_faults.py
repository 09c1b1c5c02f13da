"""The conformance runner end to end: every planted fault (conformance/engines/faults.py) is caught with the
right exit code and localized to the right layer and tap; the controls (the clean reference engine, a
perturbed golden tap, a corrupt bundle, an engine that raises, one flipped token) and run dumps give the
verdicts docs/conformance.md and docs/run-dump.md promise.

Exit codes follow the runner's precedence (integrity 5 > engine 6 > tokens 3 > DDTree 4 > numeric 1):
a fault big enough to flip a token exits 3 even though its first divergence is a numeric tap. The
expected codes below were observed on the seed-0 fixtures of tests/conftest.py and are deterministic.
"""
import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from conformance.engines.faults import FaultyEngine, msb_first, neox_perms
from conformance.engines.reference_engine import ReferenceEngine
from conformance.exit_codes import ExitCode
from conformance.records import DUMP_SCHEMA
from conformance.verify.runner import verify
from kdtr_format import Tensor, open_kdtr, write_kdtr
from kdtr_format.int4 import pack_int4, unpack_int4
from kdtr_format.interop import convert_safetensors
from refmodel.model import linear, rms_norm, rope_cos_sin


# ---------------------------------------------------------------- helpers

def failing(v) -> list[str]:
    return [c.name for c in v.checks if c.status in ("fail", "error")]


def check(v, name):
    return next(c for c in v.checks if c.name == name)


def where(v) -> str:
    """What a failed assertion prints: the verdict in one paragraph."""
    bad = [f"{c.name} [{c.status}] {c.message[:160]}" for c in v.checks if c.status in ("fail", "error")]
    return (f"exit {v.exit_code!r}, first divergence {v.first_divergence}, "
            f"{len(bad)} failing checks:\n  " + "\n  ".join(bad[:10]))


def copy_kdtr(src, dst, replace: dict) -> None:
    """Copy a bundle or run dump tensor by tensor (dtypes and INT4 shapes kept), with the tensors
    named in `replace` swapped for new arrays."""
    with open_kdtr(src) as f:
        def tensors():
            for n in f.names:
                info = f.info(n)
                yield n, Tensor(np.asarray(replace.get(n, f[n])), dtype=info.dtype, int4_shape=info.int4_shape)
        write_kdtr(dst, tensors(), f.metadata)


def atol(bundle, key: str) -> float:
    """The manifest's elementwise tolerance of golden key `key` (relative to golden/p{i}/)."""
    with open_kdtr(bundle) as f:
        e = f.metadata["tolerances"]["taps"][key]
    return e["multiplier"] * e["baseline_max_abs"] + e["abs_floor"]


def perturbed(src, dst, name: str, index: tuple, by: float):
    with open_kdtr(src) as f:
        x = np.array(f[name])
    x[index] += by
    copy_kdtr(src, dst, {name: x})
    return dst


@pytest.fixture(scope="module")
def fault_verdict(small_bundle, small_int4_bundle):
    """verify() with FaultyEngine(fault, layer, **params) on the fp32 or int4 fixture, memoised per
    module (a run is ~1 s; several tests read the same verdict)."""
    cache = {}

    def run(quant, fault, layer=None, **params):
        key = (quant, fault, layer, tuple(sorted(params.items())))
        if key not in cache:
            engine = FaultyEngine(fault, layer, **params)
            bundle = small_bundle if quant == "fp32" else small_int4_bundle
            cache[key] = (verify(bundle, engine=engine), engine)
        return cache[key]
    return run


# ---------------------------------------------------------------- the control

@pytest.mark.parametrize("quant", ["fp32", "int4"])
def test_clean_reference_engine_passes(quant, small_bundle, small_int4_bundle):
    v = verify(small_bundle if quant == "fp32" else small_int4_bundle, engine=ReferenceEngine())
    assert v.exit_code == ExitCode.OK, where(v)
    assert v.first_divergence is None
    statuses = {c.status for c in v.checks}
    assert statuses == {"pass"}, where(v)                 # no skips: the reference reports every tap
    assert len(v.checks) > 150                            # 2 prompts x (taps + tokens + DDTree)


# ---------------------------------------------------------------- planted faults

def test_scale_tap_is_caught_at_attn_out_of_its_layer(fault_verdict):
    v, _ = fault_verdict("fp32", "scale_tap", 2)
    d = v.first_divergence
    assert (v.exit_code, d.name, d.layer, d.tap, d.cause) == \
        (ExitCode.NUMERIC, "p0/prefill/L2/attn_out", 2, "attn_out", "local"), where(v)
    assert failing(v)[0] == "p0/prefill/L2/attn_out"      # nothing earlier in execution order fails
    assert d.local_error["passed"] is False


@pytest.mark.parametrize("layer", [2, 5])
def test_swap_expert_is_caught_at_mlp_out_not_routing(fault_verdict, small_bundle, layer):
    # Routing reads the router weights, not the experts', so layer L's topk_ids stay golden and the
    # first divergence is mlp_out. The swap is big: where it also flips an AR token the verdict is
    # tokens (exit 3 outranks numeric); where it does not, numeric (exit 1).
    v, engine = fault_verdict("fp32", "swap_expert", layer)
    d = v.first_divergence
    assert (d.name, d.layer, d.tap, d.cause) == (f"p0/prefill/L{layer}/mlp_out", layer, "mlp_out", "local"), where(v)
    flipped = any(c.kind == "tokens" and c.status == "fail" for c in v.checks)
    assert v.exit_code == (ExitCode.TOKENS if flipped else ExitCode.NUMERIC), where(v)
    routing = [c for c in v.checks if c.name.endswith(f"/L{layer}/topk_ids")]
    with open_kdtr(small_bundle) as f:
        prompts = f.metadata["prompts"]                                  # each: prefill + decode routing
    assert len(routing) == 2 * prompts and all(c.status == "pass" for c in routing), where(v)
    a, b = engine.experts
    with open_kdtr(small_bundle) as f:
        first_token = np.asarray(f[f"golden/p0/prefill/L{layer}/topk_ids"])[0]
        used = np.concatenate([np.asarray(f[n]).ravel() for n in f.names if n.endswith(f"/L{layer}/topk_ids")])
    assert a in first_token and b not in first_token and b in used


def test_rope_pairs_emulation_is_neox_rotate_half_on_the_raw_layout(small_bundle):
    """The permuted-weights trick (docs/model.md §3) really computes NeoX on the checkpoint's raw rope dims,
    and the engine reports q_pe / k_pe in that raw layout: checked against NeoX written out by hand."""
    ref, bad = ReferenceEngine(), FaultyEngine("rope_pairs")
    ref.load(small_bundle)
    bad.load(small_bundle)
    cfg = ref.cfg
    N, R, C = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    with open_kdtr(small_bundle) as f:
        prompt, golden_k_pe = np.asarray(f["golden/p1/prompt_ids"]), np.asarray(f["golden/p1/prefill/L0/k_pe"])
    pos = np.arange(len(prompt))
    _, taps = bad.prefill(prompt, pos)
    cos, sin = rope_cos_sin(cfg, pos, np.float32)                        # [T, R/2]

    def neox(x):                                                         # [T, .., R], pairs (i, i + R/2)
        c, s = cos.reshape(cos.shape[:1] + (1,) * (x.ndim - 2) + cos.shape[1:]), \
            sin.reshape(sin.shape[:1] + (1,) * (x.ndim - 2) + sin.shape[1:])
        x1, x2 = x[..., :R // 2], x[..., R // 2:]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

    W, x, p = ref.W, taps["L0/attn_in"], "model.layers.0.self_attn."   # raw (unpermuted) weights
    kv = linear(x, W[p + "kv_a_proj_with_mqa.weight"])                   # [T, D] -> [T, C + R]
    c_q = rms_norm(linear(x, W[p + "q_a_proj.weight"]), W[p + "q_a_layernorm.weight"], cfg.latent_norm_eps)
    q = linear(c_q, W[p + "q_b_proj.weight"]).reshape(len(pos), cfg.num_attention_heads, N + R)  # [T, H, A]
    np.testing.assert_allclose(taps["L0/k_pe"], neox(kv[:, C:]), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(taps["L0/q"][..., N:], neox(q[..., N:]), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(taps["L0/q"][..., :N], q[..., :N], rtol=1e-4, atol=1e-5)
    assert np.abs(taps["L0/k_pe"] - golden_k_pe).max() > 0.1             # and it is a real fault
    P, Q = neox_perms(R)
    assert np.array_equal(P[Q], np.arange(R)) and not np.array_equal(P, Q)


def test_rope_pairs_is_caught_in_layer0_q_and_k_pe(fault_verdict, small_bundle):
    v, _ = fault_verdict("fp32", "rope_pairs")
    assert v.exit_code == ExitCode.TOKENS, where(v)        # the wrong rotation flips p1's step 3
    # Prompt p0 is one token at position 0, where every rotation is the identity: its prefill cannot
    # see the fault. Its first decode (position 1) can, and the first layer's k_pe is where.
    assert all(c.status == "pass" for c in v.checks if c.name.startswith("p0/prefill/")), where(v)
    assert check(v, "p0/ar/L0/k_pe").status == "fail"
    assert check(v, "p0/ar/L0/kv_latent").status == "pass"
    assert [n for n in failing(v) if n.startswith("p1/")][0] == "p1/prefill/L0/q"
    assert check(v, "p1/prefill/L0/k_pe").status == "fail"


def test_rope_pairs_first_divergence_is_layer0_k_pe(fault_verdict):
    v, _ = fault_verdict("fp32", "rope_pairs")
    d = v.first_divergence
    assert (d.name, d.layer, d.tap, d.phase, d.cause) == ("p0/ar/L0/k_pe", 0, "k_pe", "ar", "local"), where(v)


def test_tree_mask_off_by_one_fails_only_ddtree(fault_verdict):
    v, _ = fault_verdict("fp32", "tree_mask_off_by_one")
    assert v.exit_code == ExitCode.DDTREE, where(v)
    assert v.first_divergence is None                      # prefill and AR never see the tree mask
    assert all(c.status == "pass" for c in v.checks if c.kind != "ddtree"), where(v)
    rounds = [check(v, f"p{i}/ddtree/rounds") for i in (0, 1)]
    assert any(c.status == "fail" and c.message.startswith("round ") for c in rounds), where(v)
    # a prompt whose accepted paths survive the wrong mask still shows it in the off-path rows (reported)
    assert all(c.status == "fail" or c.metrics["off_path_argmax_differences"] > 0 for c in rounds), where(v)


def test_nibble_order_is_caught_at_the_first_moe_layer(fault_verdict):
    v, engine = fault_verdict("int4", "nibble_order")
    L = engine.cfg.first_k_dense_replace
    d = v.first_divergence
    # every routed expert is garbage, so tokens flip too (exit 3 outranks numeric)
    assert (v.exit_code, d.name, d.layer, d.tap, d.cause) == \
        (ExitCode.TOKENS, f"p0/prefill/L{L}/mlp_out", L, "mlp_out", "local"), where(v)
    assert failing(v)[0] == f"p0/prefill/L{L}/mlp_out"
    assert check(v, f"p0/prefill/L{L}/topk_ids").status == "pass"


def test_nibble_order_on_an_fp32_bundle_is_an_engine_error(small_bundle):
    v = verify(small_bundle, engine=FaultyEngine("nibble_order"))
    assert v.exit_code == ExitCode.ENGINE_ERROR, where(v)
    assert "needs an INT4 bundle" in check(v, "engine/run").message


def test_msb_first_reverses_the_nibbles_of_each_word():
    q = np.arange(-8, 8).reshape(2, 8)                               # [2, 8]: one word per row
    assert np.array_equal(unpack_int4(msb_first(pack_int4(q))), q[:, ::-1])


def test_faulty_engine_rejects_unknown_faults_and_missing_layers():
    with pytest.raises(ValueError, match="unknown fault 'nope'; choose one of scale_tap"):
        FaultyEngine("nope")
    with pytest.raises(ValueError, match="fault 'swap_expert' needs a layer"):
        FaultyEngine("swap_expert")


# ---------------------------------------------------------------- golden-side and engine-side controls

def test_golden_tap_perturbed_by_10x_its_tolerance_fails_naming_it(small_bundle, tmp_path):
    name, index = "golden/p1/prefill/L2/mlp_out", (3, 7)
    tol = atol(small_bundle, "prefill/L2/mlp_out")
    bundle = perturbed(small_bundle, tmp_path / "b.kdtr", name, index, 10 * tol)
    v = verify(bundle, engine=ReferenceEngine())
    d = v.first_divergence
    assert v.exit_code == ExitCode.NUMERIC, where(v)
    assert failing(v) == ["p1/prefill/L2/mlp_out"], where(v)
    assert (d.name, d.layer, d.tap, d.phase, d.worst_index, d.token_position) == \
        ("p1/prefill/L2/mlp_out", 2, "mlp_out", "prefill", index, 3)
    assert check(v, d.name).min_passing["atol"] == pytest.approx(10 * tol, rel=0.05)


def test_corrupt_bundle_is_exit_5_naming_the_tensor(small_bundle, tmp_path):
    name = "golden/p0/prefill/L3/q"
    data = bytearray(small_bundle.read_bytes())
    with open_kdtr(small_bundle) as f:
        data[f.info(name).offset + 5] ^= 0x40
    bad = tmp_path / "corrupt.kdtr"
    bad.write_bytes(bytes(data))
    v = verify(bad, engine=ReferenceEngine())
    assert v.exit_code == ExitCode.INVALID_FILE, where(v)
    assert f"tensor '{name}': checksum mismatch" in check(v, "bundle/integrity").message


class RaisingEngine(ReferenceEngine):
    name = "raising"

    def decode(self, token, position):
        raise RuntimeError(f"decode kernel faulted at position {position}")


def test_engine_that_raises_is_exit_6(small_bundle):
    v = verify(small_bundle, engine=RaisingEngine())
    assert v.exit_code == ExitCode.ENGINE_ERROR, where(v)
    assert check(v, "engine/run").message == "RuntimeError: decode kernel faulted at position 1"


class SwapTop2Engine(ReferenceEngine):
    """Correct taps, but decode call `at` (from each reset) returns its logits with the top-2 entries
    swapped: an argmax/sampling bug that no tap shows."""
    name = "swap-top2"

    def __init__(self, at: int):
        super().__init__()
        self.at, self.calls = at, 0

    def reset(self):
        super().reset()
        self.calls = 0

    def decode(self, token, position):
        logits, taps = super().decode(token, position)
        if self.calls == self.at:
            a, b = np.argsort(logits[-1])[-2:]
            logits[-1, [a, b]] = logits[-1, [b, a]]
        self.calls += 1
        return logits, taps


def test_flipped_token_is_exit_3_with_step_tokens_and_margin(small_bundle):
    k = 2                                                # decode call k makes AR row / step k + 1
    v = verify(small_bundle, engine=SwapTop2Engine(k))
    assert v.exit_code == ExitCode.TOKENS, where(v)
    with open_kdtr(small_bundle) as f:
        row = np.asarray(f["golden/p0/ar/logits"][k + 1], np.float64)
        margin = float(f["golden/p0/ar/margins"][k + 1])
    top2 = np.argsort(row)[-2:]
    c = check(v, "p0/ar/tokens")
    assert c.status == "fail"
    assert c.message.startswith(f"step {k + 1}: golden token {top2[1]}, engine {top2[0]}; "
                                f"golden top-1/top-2 margin {margin:.4g}, engine logit error there "), c.message
    assert c.metrics["logit_error"] == pytest.approx(margin, rel=1e-3)
    # the taps are fine: the only numeric failures are the swapped logits rows, one per prompt
    with open_kdtr(small_bundle) as f:
        rows = [f"p{i}/ar/logits" for i in range(f.metadata["prompts"])]
    assert [n for n in failing(v) if check(v, n).kind == "numeric" and "long_position" not in n] == rows


# ---------------------------------------------------------------- run dumps (docs/run-dump.md)

@pytest.fixture(scope="module")
def saved_dump(small_bundle, tmp_path_factory):
    path = tmp_path_factory.mktemp("dump") / "run.kdtr"
    v = verify(small_bundle, engine=ReferenceEngine(), save_dump=str(path))
    assert v.exit_code == ExitCode.OK, where(v)
    return path, v


def test_run_dump_round_trip_passes_with_the_same_checks(small_bundle, saved_dump):
    path, live = saved_dump
    with open_kdtr(path) as d:
        assert d.metadata["schema"] == DUMP_SCHEMA and d.metadata["dtype"] == "float32"
        assert d.metadata["engine"] == "reference"
    v = verify(small_bundle, dump=str(path))
    assert v.exit_code == ExitCode.OK and v.engine == "dump", where(v)
    assert [(c.name, c.status) for c in v.checks] == [(c.name, c.status) for c in live.checks]


def test_run_dump_with_one_tap_perturbed_fails_naming_it(small_bundle, saved_dump, tmp_path):
    path, _ = saved_dump
    name, index = "p1/ar/L3/resid_out", (2, 5)
    bad = perturbed(path, tmp_path / "bad.kdtr", name, index, 10 * atol(small_bundle, "ar/L3/resid_out"))
    v = verify(small_bundle, dump=str(bad))
    d = v.first_divergence
    assert v.exit_code == ExitCode.NUMERIC, where(v)
    assert failing(v) == [name], where(v)
    assert (d.name, d.layer, d.tap, d.phase, d.step, d.worst_index, d.cause) == \
        (name, 3, "resid_out", "ar", 2, index, None)     # no live engine: no local/inherited verdict


def test_run_dump_written_as_safetensors_then_converted_passes(small_bundle, saved_dump, tmp_path):
    """The route docs/run-dump.md offers engines with a safetensors writer: tensors + the dump
    metadata as the JSON string __metadata__["kdtr.metadata"], then `kdtr convert`."""
    path, _ = saved_dump
    with open_kdtr(path) as d:
        tensors = {n: np.ascontiguousarray(d[n]) for n in d.names}
    st = tmp_path / "run.safetensors"
    save_file(tensors, str(st), metadata={"kdtr.metadata": json.dumps(
        {"schema": DUMP_SCHEMA, "engine": "my-engine", "dtype": "float32"})})
    convert_safetensors(st, tmp_path / "run.kdtr")
    v = verify(small_bundle, dump=str(tmp_path / "run.kdtr"))
    assert v.exit_code == ExitCode.OK, where(v)


def test_run_dump_without_the_schema_is_exit_5(small_bundle, saved_dump, tmp_path):
    path, _ = saved_dump
    with open_kdtr(path) as d:
        write_kdtr(tmp_path / "x.kdtr", {n: np.asarray(d[n]) for n in d.names}, {"engine": "x"})
    v = verify(small_bundle, dump=str(tmp_path / "x.kdtr"))
    assert v.exit_code == ExitCode.INVALID_FILE, where(v)
    assert "expected 'kdtr-run-dump/1' (docs/run-dump.md)" in check(v, "dump/integrity").message


def test_run_dump_that_reports_nothing_does_not_pass(small_bundle, tmp_path):
    write_kdtr(tmp_path / "empty.kdtr", {"unrelated": np.zeros(1, np.float32)},
               {"schema": DUMP_SCHEMA, "engine": "nothing", "dtype": "float32"})
    v = verify(small_bundle, dump=str(tmp_path / "empty.kdtr"))
    assert v.exit_code != ExitCode.OK, where(v)


# ---------------------------------------------------------------- DDTree-only numerics, malformed dumps

class TreeOnlyDrift(ReferenceEngine):
    """o_proj x (1 + 1e-4) in the tree-verify forward only: every argmax, accepted path and bonus stays
    golden, so only the committed rows' logits (ddtree/path_logits) can see it."""
    name = "tree-only-drift"

    def verify_tree(self, ids, positions, mask):
        saved = {k: v for k, v in self.W.items() if k.endswith("self_attn.o_proj.weight")}
        self.W.update({k: v * np.float32(1 + 1e-4) for k, v in saved.items()})
        try:
            return super().verify_tree(ids, positions, mask)
        finally:
            self.W.update(saved)


def test_tree_only_numeric_drift_is_a_ddtree_failure(small_bundle):
    v = verify(small_bundle, engine=TreeOnlyDrift())
    assert v.exit_code == ExitCode.DDTREE, where(v)
    assert v.first_divergence is None                      # prefill and AR are clean
    with open_kdtr(small_bundle) as f:
        n = f.metadata["prompts"]                          # the last is the long-position prompt
    assert set(failing(v)) == {f"p{i}/ddtree/path_logits" for i in range(n)} | {f"p{n - 1}/long_position"}, where(v)


@pytest.mark.parametrize("edit, says", [
    (lambda o: o.pop("p0/ddtree/round_bonus"), "p0/ddtree/round_bonus is missing (required)"),
    (lambda o: o.update({"p1/ar/tokens": o["p1/ar/tokens"][None, :]}), "p1/ar/tokens is int64[1, 8]"),
    (lambda o: o.update({"p0/ddtree/accepted_offsets": o["p0/ddtree/accepted_offsets"][::-1].copy()}),
     "p0/ddtree/accepted_offsets must start at 0"),
    (lambda o: o.update({"p0/ddtree/path_logits": o["p0/ddtree/path_logits"][:1]}), "p0/ddtree/path_logits has 1 rows"),
])
def test_malformed_run_dump_is_an_invalid_file_naming_the_tensor(small_bundle, saved_dump, tmp_path, edit, says):
    path, _ = saved_dump
    with open_kdtr(path) as d:
        out, meta = {n: np.array(d[n]) for n in d.names}, d.metadata
    edit(out)
    write_kdtr(tmp_path / "bad.kdtr", out, meta)
    v = verify(small_bundle, dump=str(tmp_path / "bad.kdtr"))
    assert v.exit_code == ExitCode.INVALID_FILE, where(v)
    assert says in check(v, "dump/structure").message


def test_run_dump_with_an_unknown_dtype_is_an_invalid_file(small_bundle, saved_dump, tmp_path):
    path, _ = saved_dump
    with open_kdtr(path) as d:
        write_kdtr(tmp_path / "x.kdtr", {n: np.array(d[n]) for n in d.names}, {**d.metadata, "dtype": "bf16"})
    v = verify(small_bundle, dump=str(tmp_path / "x.kdtr"))
    assert v.exit_code == ExitCode.INVALID_FILE, where(v)
    assert "metadata dtype 'bf16'" in check(v, "dump/integrity").message
