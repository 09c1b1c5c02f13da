"""`--engine torch`: transformers' DeepseekV3 (or a user's port) judged against the golden bundles on CPU.

- float32 on both committed bundles passes every check but the long-position prompt's, and observes every
  tap (nothing skipped): transformers forms RoPE angles in float32 (position x inv_freq), off by up to
  4e-3 rad at position 196608, so the bundles' long-position prompt fails it by design, at L0/q, and its
  named check says so (docs/golden-bundles.md); nothing is held (the fp32 profile was derived free);
- bfloat16 passes the bundles' derived bf16 profile, its routing held to the golden expert sets as the
  profile was derived (its own near-tie expert flips are judged at topk_ids with its own router scores),
  and fails the fp32 profile at once; these two need bundles whose decode steps record router_scores;
- a routing bug (the correction bias ignored, or added to the logits) still fails in bfloat16 with routing
  held, at its topk_ids;
- a planted bug in a user module (k's RoPE pairs de-interleaved, q's right) is caught at layer 0's k_pe,
  localised as a local fault, in float32 and in bfloat16.
"""
import collections

import numpy as np
import pytest
from click.testing import CliRunner

from cli.main import main
from conformance.engines.torch_engine import TorchEngine, TorchEngineError
from conformance.exit_codes import ExitCode
from conformance.verify.runner import verify
from kdtr_format import open_kdtr

BUNDLES = ["bundles/model_tiny.kdtr", "bundles/model_int4_tiny.kdtr"]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The tiny model's ops are microseconds long: on a loaded 2-core CI box torch's thread pool costs
    ~17x (a bundle in 82 s instead of 4.7 s, measured), so these tests run torch on one thread."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
USER = "torch_user_models:"


def long_position_prompt(bundle) -> int:
    with open_kdtr(bundle) as f:
        return next(k for k, o in enumerate(f.metadata["position_offsets"]) if o)


def worst_ratios(v, leave_out: int | None = None) -> dict:
    """Worst error/bound ratio per (check kind, phase, tap): the margin a passing engine has left.
    `leave_out`: a prompt whose checks are not counted (one that fails by design)."""
    worst = collections.defaultdict(float)
    for c in v.checks:
        if "ratio" in c.metrics and not c.name.startswith(f"p{leave_out}/"):
            parts = c.name.split("/")
            worst[(c.kind, parts[1], parts[-1])] = max(worst[(c.kind, parts[1], parts[-1])], c.metrics["ratio"])
    return dict(worst)


def skipped_taps(v) -> list:
    """Skipped checks but those of the steps kdtr performs for a torch model (conformance/verify/not_judged.py:
    INT4 decoding for transformers' model, the cache compaction, the DDTree loop, which it has not)."""
    return [c.name for c in v.checks if c.status == "skip" and not c.message.startswith(
        ("done by kdtr, not judged", "not run: the outputs hold no ddtree_live/ group"))]


def not_passed(v) -> list:
    return [(c.name, c.status, c.message) for c in v.checks if c.status != "pass"]


def only_the_long_position_prompt_fails(v, first_tap="q"):
    """transformers' float32 RoPE angles: every failure is the long-position prompt's, starting at the
    first rotated tap the engine reports (L0/q; L0/k_pe when q is unobservable), and diagnosed so."""
    i = long_position_prompt(v.bundle)
    failed = [c for c in v.checks if c.status in ("fail", "error")]
    assert v.exit_code == ExitCode.NUMERIC and failed, not_passed(v)[:5]
    assert all(c.name.startswith(f"p{i}/") for c in failed), [c.name for c in failed][:5]
    assert v.first_divergence.name == f"p{i}/prefill/L0/{first_tap}", v.first_divergence
    named = next(c for c in failed if c.name == f"p{i}/long_position")
    assert "forms RoPE angles in float32" in named.message
    top = v.diagnosis[0]                                                # docs/diagnosis.md: recomputed, matched
    assert (top["id"], top["kind"]) == ("rope-float32-angles", "matched"), v.diagnosis


@pytest.mark.parametrize("bundle", BUNDLES)
def test_transformers_float32_passes_every_check_but_the_long_position_prompt(bundle):
    e = TorchEngine("float32")
    v = verify(bundle, engine=e)
    worst = worst_ratios(v, leave_out=long_position_prompt(bundle))
    print(f"\n{bundle}: torch float32, worst error/bound per group (the long-position prompt left out):")
    for k in sorted(worst):
        print(f"  {'/'.join(k):32s} {worst[k]:.3f}")
    only_the_long_position_prompt_fails(v)
    assert not skipped_taps(v)                                          # every tap observed, nothing skipped
    steps = ["cache_compaction", "ddtree_loop"] if bundle.endswith("model_tiny.kdtr") else [
        "int4_decode", "cache_compaction", "ddtree_loop"]
    assert [d["step"] for d in v.done_by_kdtr] == steps                 # what kdtr did for it: not judged
    assert v.info["profile"] == "fp32"
    assert v.info["routing"] == "free: the engine's own router chose every expert set" and e.held_rows == 0


def has_decode_router_scores(bundle) -> bool:
    with open_kdtr(bundle) as f:
        return "router_scores" in f.metadata["taps"]["ar"]


@pytest.mark.parametrize("bundle", BUNDLES)
def test_bfloat16_passes_the_bf16_profile_and_fails_the_fp32_profile(bundle):
    """Under the bf16 profile (derived with routing held to the golden experts: arithmetic noise only)
    transformers in bfloat16, its routing held alike, passes: its expert flips between near-equal routing
    scores (the tiny model's routing gaps reach 7e-5, below bf16 noise) are near-ties its own float32
    router scores explain, judged at topk_ids, and no longer move every later tap. The same run judged by
    the fp32 profile fails at the first tap: the profile is not decorative."""
    assert has_decode_router_scores(bundle), (f"{bundle} records no decode router_scores: regenerate it with "
                                              f"the bundles/MANIFEST.md commands")
    e = TorchEngine("bfloat16")
    v16 = verify(bundle, engine=e)                                      # default: the engine's dtype
    skipped = [(c.name, c.message) for c in v16.checks if c.status == "skip"]
    ties = [c.name for c in v16.checks if c.metrics.get("near_tie_rows") or c.metrics.get("near_ties")]
    print(f"\n{bundle}: torch bfloat16, bf16 profile: {ExitCode(v16.exit_code).name}, {len(v16.checks)} checks, "
          f"{len(ties)} with near-ties, {e.held_rows} rows ran held experts, worst ratio "
          f"{max(worst_ratios(v16).values()):.3f}; skipped {skipped}")
    assert v16.info["profile"] == "bf16" and v16.info["routing"].startswith("held to the golden expert sets")
    assert v16.exit_code == ExitCode.OK, not_passed(v16)[:5]
    v32 = verify(bundle, engine=TorchEngine("bfloat16"), profile="fp32")
    failed = [c.name for c in v32.checks if c.status == "fail"]
    print(f"fp32 profile: {ExitCode(v32.exit_code).name}, {len(failed)} of {len(v32.checks)} checks fail, first "
          f"divergence {v32.first_divergence.name}")
    assert v32.exit_code != ExitCode.OK and failed
    assert v32.first_divergence.name == "p0/prefill/L0/attn_in"        # bf16 rounding shows at once
    assert [(x["id"], x["kind"]) for x in v32.diagnosis][:1] == [("numerics-bf16", "consistent")], v32.diagnosis
    assert v32.info["routing"].startswith("free")                       # the fp32 profile holds nothing


@pytest.mark.parametrize("module", ["BiasFreeRouterForCausalLM", "BiasOnLogitsRouterForCausalLM"])
def test_a_routing_bug_still_fails_with_routing_held(small_bundle, module):
    """A router that ignores the correction bias, or adds it to the logits, in bfloat16 under the bf16
    profile: the runner holds its routing to the golden experts, so the wrong choice does not reach
    mlp_out, but the choice itself is judged at topk_ids, where its own scores + the bias do not choose
    its experts: no near-tie."""
    with open_kdtr(small_bundle) as f:
        first_moe = f.metadata["model_config"]["first_k_dense_replace"]
    v = verify(small_bundle, engine=TorchEngine("bfloat16", module=USER + module))
    failed = [c.name for c in v.checks if c.status == "fail"]
    d = v.first_divergence
    print(f"\n{module}, bfloat16, held: {len(failed)} failures, first divergence {d.name} ({d.cause})")
    assert v.info["routing"].startswith("held") and v.exit_code != ExitCode.OK
    assert (d.phase, d.tap, d.cause) == ("prefill", "topk_ids", "local") and d.layer >= first_moe, d
    assert any(n.endswith("/topk_ids") and "/ar/" in n for n in failed), failed     # decode routing too
    # held: it ran the golden experts (under bf16 the near-tie reach, 2 x the wide router atol, takes in
    # every row this bug chooses wrongly; a row outside it would run the bug's experts and fail mlp_out)
    assert not [n for n in failed if n.endswith("/mlp_out")], failed


def test_a_bf16_run_dump_is_judged_with_the_bf16_profile(small_bundle, tmp_path):
    """--save-dump writes the run with dtype bfloat16; judging the dump picks the bf16 profile from it
    and gives the live run's verdict, check by check."""
    dump = tmp_path / "run.kdtr"
    live = verify(small_bundle, engine=TorchEngine("bfloat16"), save_dump=str(dump))
    v = verify(small_bundle, dump=str(dump))
    assert (v.info["dtype"], v.info["profile"]) == ("bfloat16", "bf16")
    assert v.exit_code == live.exit_code
    assert [(c.name, c.status) for c in v.checks] == [(c.name, c.status) for c in live.checks]
    assert v.done_by_kdtr == live.done_by_kdtr and live.done_by_kdtr    # recorded in the dump's metadata
    # the dump records that its run held routing, and the verdict says so (not "free")
    assert live.info["routing"].startswith("held to the golden expert sets")
    assert v.info["routing"] == ("held to the golden expert sets by the run that wrote this dump "
                                 "(its metadata routing: held)")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_planted_k_rope_bug_is_caught_at_layer0_k_pe(small_bundle, dtype):
    v = verify(small_bundle, engine=TorchEngine(dtype, module=USER + "KRopeBugForCausalLM"))
    d = v.first_divergence
    print(f"\n{dtype}: k-rope bug -> {ExitCode(v.exit_code).name}, first divergence {d.name} ({d.cause}), "
          f"local {d.local_error}")
    assert v.exit_code != ExitCode.OK
    assert (d.name, d.layer, d.tap, d.phase, d.cause) == ("p0/prefill/L0/k_pe", 0, "k_pe", "prefill", "local")
    fine = {c.name: c.status for c in v.checks}
    assert all(fine[f"p0/prefill/L0/{t}"] == "pass" for t in ("attn_in", "q", "kv_latent"))
    assert fine["p0/prefill/L0/k_pe"] == "fail"
    assert (v.diagnosis[0]["id"], v.diagnosis[0]["kind"]) == ("rope-layout", "matched"), v.diagnosis


def test_a_faithful_user_port_passes_but_for_float32_rope_angles(small_bundle):
    v = verify(small_bundle, engine=TorchEngine("float32", module=USER + "PortForCausalLM"))
    only_the_long_position_prompt_fails(v)                              # it uses transformers' rotary embedding
    assert not skipped_taps(v)


def test_an_unobservable_tap_is_skipped_with_the_reason(small_bundle):
    v = verify(small_bundle, engine=TorchEngine("float32", module=USER + "OwnAttentionForCausalLM"))
    skipped = [c for c in v.checks if c.name in skipped_taps(v)]
    only_the_long_position_prompt_fails(v, first_tap="k_pe")
    assert skipped and {c.name.rsplit("/", 1)[-1] for c in skipped} == {"q"}
    assert "does not call transformers' attention interface" in skipped[0].message


def test_run_layer_on_golden_inputs_is_within_tolerance(small_bundle):
    """Teacher forcing: layer 2 of decode step 3 alone, fed golden hidden state and golden cache rows."""
    from conformance.tolerance import DerivedTolerance, check_tap
    e = TorchEngine("float32")
    with open_kdtr(small_bundle) as f:
        e.load(f)
        g, l, s = "golden/p1/", 2, 3
        P = len(f[g + "prompt_ids"])
        cat = lambda t: np.concatenate([f[g + f"prefill/L{l}/{t}"], f[g + f"ar/L{l}/{t}"][:s]])  # noqa: E731
        taps = e.run_layer(l, {"hidden": f[g + f"ar/L{l - 1}/resid_out"][s:s + 1], "positions": np.array([P + s]),
                               "c_kv": cat("kv_latent"), "k_pe": cat("k_pe")})
        man = f.metadata["tolerances"]["taps"]
        for t in ("kv_latent", "k_pe", "resid_out"):
            rule = DerivedTolerance.from_dict(man[f"ar/L{l}/{t}"]).rule()
            r = check_tap(f[g + f"ar/L{l}/{t}"][s:s + 1], taps[f"L{l}/{t}"], rule)
            assert r.passed, (t, r.failures)


def test_hold_routing_runs_the_held_experts_for_one_call_and_reports_its_own_choice(small_bundle):
    """Prefill row 0 of layer `first_k_dense_replace` held to the golden set with one expert swapped: that
    row's mlp_out is the float64 reference's with the same experts forced (within the bundle's fp32 rule,
    which the free row fails), the taps still report the router's own choice, and the hold lasts one call."""
    from refmodel.stored import read_model
    from conformance.tolerance import DerivedTolerance, check_tap
    from refmodel.model import forward
    e = TorchEngine("float32")
    with open_kdtr(small_bundle) as f:
        e.load(f)
        cfg, W = read_model(f)
        l, prompt = cfg.first_k_dense_replace, np.asarray(f["golden/p0/prompt_ids"])
        pos = np.arange(len(prompt))                                     # p0: position offset 0
        gold = np.array(f[f"golden/p0/prefill/L{l}/topk_ids"])
        rule = DerivedTolerance.from_dict(f.metadata["tolerances"]["taps"][f"prefill/L{l}/mlp_out"]).rule()
    forced = gold.copy()
    forced[0, 0] = next(x for x in range(cfg.n_routed_experts) if x not in gold[0])
    held = np.full_like(gold, -1)
    held[0] = forced[0]                                                  # other rows: the router decides
    _, free = e.prefill(prompt, pos)
    e.reset()
    e.hold_routing({l: held})
    _, taps = e.prefill(prompt, pos)
    oracle = {}
    forward(cfg, W, prompt, pos, taps=oracle, forced_ids={l: forced})
    assert e.held_rows == 1
    np.testing.assert_array_equal(taps[f"L{l}/topk_ids"], free[f"L{l}/topk_ids"])   # its own choice
    assert check_tap(oracle[f"L{l}/mlp_out"], taps[f"L{l}/mlp_out"], rule).passed
    assert not check_tap(oracle[f"L{l}/mlp_out"][:1], free[f"L{l}/mlp_out"][:1], rule).passed
    e.reset()
    _, again = e.prefill(prompt, pos)                                    # one call only: free again
    assert e.held_rows == 1
    np.testing.assert_array_equal(again[f"L{l}/mlp_out"], free[f"L{l}/mlp_out"])
    e.reset()
    e.hold_routing({l: np.concatenate([held, held])})                    # a row per token, twice over
    with pytest.raises(TorchEngineError, match=rf"hold_routing: layer {l} got held ids of shape "
                                               rf"\({2 * len(prompt)}, {cfg.num_experts_per_tok}\) for a forward"):
        e.prefill(prompt, pos)


def test_it_is_an_engine():
    from conformance.engines.protocol import check_engine
    assert check_engine(TorchEngine("bfloat16")) == []


def test_bad_modules_are_refused_clearly(small_bundle):
    """Each in one line; a name mismatch from the bundle's side (its tensors the module lacks first)."""
    with pytest.raises(TorchEngineError, match=r"RenamedForCausalLM's parameters do not carry the HF names of the "
                                               r"bundle: the bundle's \d+ tensor\(s\) lm_head.weight, "
                                               r"model.embed_tokens.weight, model.layers.0.input_layernorm.weight "
                                               r"and \d+ more have no parameter of that name in the module; the "
                                               r"module's 1 parameter\(s\) embed.weight are not in the bundle"):
        TorchEngine("float32", module=USER + "RenamedForCausalLM").load(str(small_bundle))
    with pytest.raises(TorchEngineError, match="cannot import 'no_such_pkg'"):
        TorchEngine("float32", module="no_such_pkg:Model").load(str(small_bundle))
    with pytest.raises(TorchEngineError, match=r"torch_user_models has no 'NoSuchPort' \(its classes: "
                                               r"BiasFreeRouter, .*PortForCausalLM"):
        TorchEngine("float32", module=USER + "NoSuchPort")
    with pytest.raises(TorchEngineError, match="torch_user_models.rotate_interleaved is a function, not a class"):
        TorchEngine("float32", module=USER + "rotate_interleaved")
    with pytest.raises(TorchEngineError, match=r"examples.numpy_engine.NumpyEngine is not a torch.nn.Module class "
                                               r"\(.* runs with --engine python"):
        TorchEngine("float32", module="examples.numpy_engine:NumpyEngine")
    with pytest.raises(TorchEngineError, match="the torch engine runs float32 or bfloat16"):
        TorchEngine("float16")


def test_cli_engine_torch(small_bundle):
    r = CliRunner().invoke(main, ["verify", str(small_bundle), "--engine", "torch", "--dtype", "bfloat16"])
    assert r.exit_code == 0, r.output
    assert "tolerance profile: bf16" in r.output and "routing: held to the golden expert sets" in r.output
    r = CliRunner().invoke(main, ["verify", str(small_bundle), "--engine", "reference", "--dtype", "bfloat16"])
    assert r.exit_code == 2 and "--dtype and --module apply to --engine torch" in r.output


def test_an_interleaved_rope_port_is_judged_in_the_layout_it_declares(small_bundle):
    """Correct math in the checkpoint's interleaved RoPE layout: declared, it passes as the faithful port
    does (all but the float32-angle long-position prompt); undeclared, it is judged in transformers'
    layout and fails at layer 0's q, localised as local."""
    v = verify(small_bundle, engine=TorchEngine("float32", module=USER + "InterleavedPortForCausalLM"))
    only_the_long_position_prompt_fails(v)
    assert not skipped_taps(v)
    e = TorchEngine("float32", module=USER + "UndeclaredInterleavedPortForCausalLM")
    assert "the class declares no kdtr_rope_layout" in e.describe()
    d = verify(small_bundle, engine=e).first_divergence
    assert (d.name, d.cause) == ("p0/prefill/L0/q", "local"), d


def test_a_tuple_output_is_one_line(small_bundle):
    v = verify(small_bundle, engine=TorchEngine("float32", module=USER + "TupleOutputForCausalLM"))
    err = next(c for c in v.checks if c.name == "engine/run")
    assert v.exit_code == ExitCode.ENGINE_ERROR
    assert err.message == ("TorchEngineError: TupleOutputForCausalLM.forward returned a tuple, not an output object "
                           "with .logits [1, T, V] (return transformers' CausalLMOutputWithPast, or any object with a "
                           "`logits` attribute; docs/engine-api.md)")


def test_a_port_without_rotary_emb_hears_up_front_that_localisation_will_not_work(small_bundle):
    said = []
    v = verify(small_bundle, engine=TorchEngine("float32", module=USER + "NoRotaryForCausalLM"), announce=said.append)
    assert len(said) == 1 and "has no model.rotary_emb: run_layer builds a layer's position embeddings" in said[0]
    only_the_long_position_prompt_fails(v)                              # it runs; only localisation is lost
    assert v.first_divergence.cause == f"not localised: {said[0]}"
