"""Routing near-ties judged, not forbidden, under the fp32 profile (`kdtr gen --routing-near-ties held`).

The bundle here has a genuine near-tie: the tiny model with one correction-bias entry moved so that, at
decode step 2 of prompt 1, layer 1's K-th and (K+1)-th biased golden scores are equal to within 1e-8
(the router_scores atol is ~4e-6), made with the real generator. Then:

- the bundle says `routing: "held"`, and the fp32 profile holds a live engine's routing like bf16 does;
- the reference engine and the torch engine pass it (whatever their float32 routers choose at the tie);
- a routing bug (the correction bias ignored) still fails, at its topk_ids, with the MoE held (and in its
  live DDTree, whose router is free);
- an engine whose own router scores, within the tolerance, choose the other side of the near-tie passes
  (its flip is a near-tie at topk_ids; later taps ran the golden experts); the same engine pushed to flip a
  decisive decision fails at router_scores and topk_ids;
- the live DDTree (its router free) is judged exactly before the first near-tie routing row and for
  self-consistency after it (conformance/verify/judge_live.py);
- run dumps say how their run routed; a bundle whose `tolerances.routing` is neither value is invalid.
"""
import numpy as np
import pytest

from conformance.engines.reference_engine import ReferenceEngine
from conformance.exit_codes import ExitCode
from conformance.gen.bundle_model import as_stored
from conformance.gen.gen import GenSettings, apply_quant, generate_bundle, model_from_preset
from conformance.gen.goldens import random_prompt, run_reference
from conformance.tolerance import entry_atol
from conformance.verify.collect import collect
from conformance.verify.context import Prompt, Run
from conformance.verify.judge_live import live_checks
from conformance.verify.near_ties import routing_tie_row
from conformance.verify.outputs import LIVE
from conformance.verify.runner import verify
from conformance.verify.tree_ties import GoldenDrafts
from kdtr_format import open_kdtr
from refmodel.config import ModelConfig
from refmodel.model import expert_weights

PROMPT, STEP, LAYER = 1, 2, 1          # the near-tie: prompt 1, decode step 2, layer 1 (the first MoE layer)


def not_passed(v) -> list:
    return [(c.name, c.status, c.message) for c in v.checks if c.status != "pass"]


@pytest.fixture(scope="module")
def near_tie_bundle(tmp_path_factory):
    """(path, the tie's cache row, (expert in the golden set, expert out of it)): the small fixture's
    settings with --routing-near-ties held and no long-position prompt (transformers' float32 RoPE angles
    fail that one by design, tests/test_torch_engine.py), and one bias entry moved to make the tie."""
    s = GenSettings(quant="fp32", num_prompts=2, max_new_tokens=8, distill_steps=0, seed=0, long_position=0,
                    bf16_profile=False, routing_near_ties="held", command="test fixture (fp32, routing held)")
    m = apply_quant(model_from_preset(s), s)
    K, key = m.cfg.num_experts_per_tok, f"model.layers.{LAYER}.mlp.gate.e_score_correction_bias"
    prompt = random_prompt(m.cfg, s.seed, PROMPT, 0)                   # the generator's first draw
    g64, _, _, _ = run_reference(m.cfg, as_stored(m.W), prompt, s.max_new_tokens)
    choice = g64[f"ar/L{LAYER}/router_scores"][STEP] + m.W[key].astype(np.float64)   # [E]
    order = np.argsort(-choice, kind="stable")
    kth, nxt = int(order[K - 1]), int(order[K])
    bias = m.W[key].copy()
    bias[nxt] = np.float32(float(bias[nxt]) + choice[kth] - choice[nxt] - 1e-9)    # the (K+1)-th joins the K-th
    m.W[key] = bias
    out = tmp_path_factory.mktemp("held") / "near_tie.kdtr"
    generate_bundle(m, s, str(out))
    with open_kdtr(out) as f:
        g = f"golden/p{PROMPT}/"
        assert np.array_equal(f[g + "prompt_ids"], prompt), "the generator redrew the crafted prompt"
        ids = set(np.asarray(f[g + f"ar/L{LAYER}/topk_ids"])[STEP].tolist())
    return out, len(prompt) + STEP, (kth, nxt) if kth in ids else (nxt, kth)


def test_the_bundle_holds_routing_and_records_its_near_tie(near_tie_bundle):
    path, row, (inside, outside) = near_tie_bundle
    with open_kdtr(path) as f:
        meta, cfg = f.metadata, ModelConfig.from_dict(f.metadata["model_config"])
        man = meta["tolerances"]["taps"]
        assert meta["tolerances"]["routing"] == "held" and meta["figures"]["routing_near_ties"] >= 1
        g = f"golden/p{PROMPT}/"
        bias = np.asarray(f.get(f"model.layers.{LAYER}.mlp.gate.e_score_correction_bias"), np.float64)
        choice = np.asarray(f[g + f"ar/L{LAYER}/router_scores"])[STEP] + bias
        atol = entry_atol(man[f"ar/L{LAYER}/router_scores"])
        print(f"\nnear-tie gap {choice[inside] - choice[outside]:.3g}, router_scores atol {atol:.3g}")
        assert abs(choice[inside] - choice[outside]) <= 2 * atol        # stored goldens: float32-rounded
        assert routing_tie_row(f, g, man, cfg) == row


def test_reference_and_torch_engines_pass_with_routing_held(near_tie_bundle):
    pytest.importorskip("torch")
    from conformance.engines.torch_engine import TorchEngine

    path = near_tie_bundle[0]
    for e in (ReferenceEngine(), TorchEngine("float32")):
        v = verify(path, engine=e)
        ties = [(c.name, c.message) for c in v.checks if "near-tie" in c.message]
        print(f"\n{e.name}: {v.info['routing']}; near-tie notes: {ties}")
        assert v.info["profile"] == "fp32" and v.info["routing"].startswith("held to the golden expert sets")
        assert v.exit_code == ExitCode.OK, not_passed(v)[:5]


def test_a_free_bundle_still_holds_nothing(small_bundle):
    with open_kdtr(small_bundle) as f:
        assert "routing" not in f.metadata["tolerances"]
    e = ReferenceEngine()
    v = verify(small_bundle, engine=e)
    assert v.info["routing"] == "free: the engine's own router chose every expert set" and e.held_rows == 0


class BiasIgnored(ReferenceEngine):
    """A routing bug: layer LAYER's router chooses experts on its unbiased scores (the bias zeroed)."""

    def load(self, bundle):
        super().load(bundle)
        key = f"model.layers.{LAYER}.mlp.gate.e_score_correction_bias"
        self.W = dict(self.W.items())
        self.W[key] = np.zeros_like(self.W[key])


def test_a_routing_bug_still_fails_at_its_topk_ids_with_routing_held(near_tie_bundle):
    v = verify(near_tie_bundle[0], engine=BiasIgnored())
    failed = [c.name for c in v.checks if c.status == "fail"]
    d = v.first_divergence
    print(f"\nbias ignored at L{LAYER}, fp32 held: {len(failed)} failures, first divergence {d.name} ({d.cause})")
    assert v.info["routing"].startswith("held") and v.exit_code != ExitCode.OK
    assert (d.phase, d.layer, d.tap, d.cause) == ("prefill", LAYER, "topk_ids", "local"), d
    # only near-tie rows are held: at its decisive rows the bug's own experts ran, so the MoE output after
    # the wrong choice fails too, and so does its live DDTree (its wrong experts move that stream)
    assert f"p0/prefill/L{LAYER}/mlp_out" in failed, failed
    assert any(f"/{LIVE}/" in n for n in failed), failed


class GateNudge(ReferenceEngine):
    """An engine whose router weight row of one expert in layer LAYER is off by a rank-1 term that moves
    that expert's logit by `delta` at the golden router input `x` of one token (and, in proportion, at
    every other token): a real change in the computation, which its router scores show and its own top-K
    of its own scores + bias follows, as a correct router's would."""

    def __init__(self, layer: int, expert: int, x: np.ndarray, delta: float):
        super().__init__()
        self.layer, self.expert, self.x, self.delta = layer, expert, x, delta

    def load(self, bundle):
        super().load(bundle)
        key = f"model.layers.{self.layer}.mlp.gate.weight"                # [E, D]
        self.W = dict(self.W.items())
        gate = np.array(self.W[key])
        gate[self.expert] += (self.delta * self.x / (self.x @ self.x)).astype(gate.dtype)
        self.W[key] = gate


def router_input(f, g: str, layer: int, step: int) -> np.ndarray:
    """The golden router input (mlp_in [D]) of decode step `step` at `layer`, from the decode taps: the
    post-attention RMSNorm of the previous layer's output plus this layer's attention output."""
    from refmodel.model import rms_norm

    cfg = ModelConfig.from_dict(f.metadata["model_config"])
    h = np.asarray(f[g + f"ar/L{layer - 1}/resid_out"])[step] + np.asarray(f[g + f"ar/L{layer}/attn_out"])[step]
    w = np.asarray(f.get(f"model.layers.{layer}.post_attention_layernorm.weight"), np.float64)
    return rms_norm(h[None], w, cfg.rms_norm_eps)[0]


def nudge(f, layer: int, expert: int, step: int, score_change: float) -> GateNudge:
    """A GateNudge moving `expert`'s router score at decode step `step` of prompt PROMPT by about
    `score_change` (the sigmoid's slope s (1 - s) turns a logit change into a score change)."""
    g = f"golden/p{PROMPT}/"
    s = float(np.asarray(f[g + f"ar/L{layer}/router_scores"])[step][expert])
    return GateNudge(layer, expert, router_input(f, g, layer, step), score_change / (s * (1 - s)))


def test_an_engine_whose_own_scores_take_the_other_side_of_a_near_tie_passes(near_tie_bundle):
    """Its expert set differs from the golden one at the near-tie row only: a near-tie at topk_ids (its own
    scores + bias choose it; the golden gap is within 2 router atol); the MoE ran the golden experts, so
    no later tap moves. Its live DDTree, whose router is free, may leave the golden stream from there."""
    path, row, (inside, outside) = near_tie_bundle
    with open_kdtr(path) as f:
        atol = entry_atol(f.metadata["tolerances"]["taps"][f"ar/L{LAYER}/router_scores"])
        e = nudge(f, LAYER, outside, STEP, atol / 4)                     # the outside expert rises past the tie
    v = verify(path, engine=e)
    assert v.exit_code == ExitCode.OK, not_passed(v)[:5]
    c = next(c for c in v.checks if c.name == f"p{PROMPT}/ar/L{LAYER}/topk_ids")
    assert c.metrics.get("near_tie_rows") == [STEP], (c.metrics, c.message)
    assert e.held_rows >= 1                                              # it ran the golden set there
    live = next(c for c in v.checks if c.name == f"p{PROMPT}/{LIVE}/tokens")
    trees = next(c for c in v.checks if c.name == f"p{PROMPT}/{LIVE}/trees")
    print(f"\nnudged engine: {c.message}; live: {live.message}; trees: {trees.message}")
    assert trees.metrics["after_routing_tie"] >= 1 and trees.metrics["compared"] > trees.metrics["after_routing_tie"]


def test_the_same_engine_flipping_a_decisive_decision_fails(near_tie_bundle):
    """Pushed to flip a decisive decision (layer LAYER + 1, the same step: gap ~0.03, far outside 2 atol),
    its scores must move by the gap: router_scores fails, and the flip at topk_ids is no near-tie."""
    path = near_tie_bundle[0]
    layer = LAYER + 1
    with open_kdtr(path) as f:
        K = f.metadata["model_config"]["num_experts_per_tok"]
        g = f"golden/p{PROMPT}/"
        bias = np.asarray(f.get(f"model.layers.{layer}.mlp.gate.e_score_correction_bias"), np.float64)
        choice = np.asarray(f[g + f"ar/L{layer}/router_scores"])[STEP] + bias
        order = np.argsort(-choice, kind="stable")
        gap = choice[order[K - 1]] - choice[order[K]]
        atol = entry_atol(f.metadata["tolerances"]["taps"][f"ar/L{layer}/router_scores"])
        assert gap > 4 * atol                                            # decisive
        e = nudge(f, layer, int(order[K]), STEP, 1.5 * gap)
    v = verify(path, engine=e)
    failed = {c.name for c in v.checks if c.status == "fail"}
    print(f"\ndecisive flip: gap {gap:.3g} ({gap / atol:.0f} atol), first divergence {v.first_divergence.name}")
    assert v.exit_code == ExitCode.NUMERIC
    assert f"p{PROMPT}/ar/L{layer}/router_scores" in failed and f"p{PROMPT}/ar/L{layer}/topk_ids" in failed
    c = next(c for c in v.checks if c.name == f"p{PROMPT}/ar/L{layer}/topk_ids")
    assert STEP not in c.metrics.get("near_tie_rows", []), c.metrics


def test_the_live_stream_may_leave_the_golden_one_only_from_the_near_tie_on(near_tie_bundle):
    """The nudged engine's live DDTree (router free) takes the other side of the near-tie at cache row
    `row` and leaves the golden stream at token row - P + 1, the token that row predicts. Judged with the
    rule, that is allowed; without it (a bundle whose routing is free) it fails; and the same departure
    before the first token a near-tie may move (the tie placed one row later) fails too."""
    path, row, (inside, outside) = near_tie_bundle
    with open_kdtr(path) as f:
        atol = entry_atol(f.metadata["tolerances"]["taps"][f"ar/L{LAYER}/router_scores"])
        e = nudge(f, LAYER, outside, STEP, atol / 4)
        e.load(f)
        out = collect(e, f, hold_routing=True, man=f.metadata["tolerances"]["taps"])
        g, P = f"golden/p{PROMPT}/", len(f[f"golden/p{PROMPT}/prompt_ids"])
        gold, mine = np.asarray(f[g + "ddtree/tokens"]), out[f"p{PROMPT}/{LIVE}/tokens"]
        first = int(np.nonzero(gold != mine)[0][0])
        assert first == row - P + 1, (first, row, P)                    # it parts exactly at the tie

        def tokens_check(tie_row):
            return next(c for c in live_checks(Prompt.of(Run.of(f), PROMPT), out, GoldenDrafts(f), True, tie_row)
                        if c.name.endswith(f"{LIVE}/tokens"))

        assert tokens_check(row).status == "pass"
        assert tokens_check(None).status == "fail"
        late = tokens_check(row + 1)
        assert late.status == "fail" and f"at token {first}" in late.message


def test_a_bundle_with_another_routing_value_is_an_invalid_file(small_bundle, tmp_path):
    from kdtr_format import Tensor, write_kdtr

    bad = tmp_path / "sideways.kdtr"
    with open_kdtr(small_bundle) as f:
        meta = dict(f.metadata, tolerances=dict(f.metadata["tolerances"], routing="sideways"))
        write_kdtr(bad, ((n, Tensor(np.asarray(f[n]), dtype=f.info(n).dtype, int4_shape=f.info(n).int4_shape))
                         for n in f.names), meta)
    v = verify(str(bad), engine=ReferenceEngine())
    assert v.exit_code == ExitCode.INVALID_FILE
    assert "metadata tolerances.routing is 'sideways', must be \"held\" or \"free\" (or left out)" in v.checks[-1].message


def test_run_dumps_of_a_held_bundle_say_how_they_routed(near_tie_bundle, tmp_path):
    """--save-dump records the held run as held; a dump that ran free is judged with the caveat."""
    from conformance.records import read_dump, write_dump

    path, dump = near_tie_bundle[0], str(tmp_path / "run.kdtr")
    assert verify(path, engine=ReferenceEngine(), save_dump=dump).exit_code == ExitCode.OK
    v = verify(path, dump=dump)
    assert v.exit_code == ExitCode.OK
    assert v.info["routing"].startswith("held to the golden expert sets by the run that wrote this dump")
    out, _ = read_dump(dump)
    write_dump(out, dump, "reference", "float32", routing="free")
    v = verify(path, dump=dump)
    assert v.info["routing"].startswith("free: the run that wrote this dump let its router choose every expert "
                                        "set, but the fp32 profile was derived with routing held"), v.info["routing"]


class EchoingWrongRouter(ReferenceEngine):
    """A wrong router (its selection ignores the correction bias in every MoE layer) that reports the held
    expert ids as its own choice wherever a row is held, and has no live DDTree."""

    def __getattribute__(self, name):
        if name == "ddtree_generate":                   # the optional live DDTree: this engine has none
            raise AttributeError(name)
        return object.__getattribute__(self, name)

    def load(self, bundle):
        super().load(bundle)
        self.W = dict(self.W.items())
        for l in range(self.cfg.first_k_dense_replace, self.cfg.num_hidden_layers):
            k = f"model.layers.{l}.mlp.gate.e_score_correction_bias"
            self.W[k] = np.zeros_like(self.W[k])

    def _forward(self, ids, positions, mask=None):
        held = dict(self._held_ids)
        logits, taps = super()._forward(ids, positions, mask)
        for l, v in held.items():
            rows = (np.asarray(v) >= 0).all(-1)
            own = taps[f"L{l}/topk_ids"].copy()
            own[rows] = np.asarray(v)[rows]
            taps[f"L{l}/topk_ids"] = own
            taps[f"L{l}/topk_weights"] = expert_weights(self.cfg, taps[f"L{l}/router_scores"], own)
        return logits, taps


def test_an_engine_that_echoes_the_held_ids_cannot_hide_a_wrong_router(near_tie_bundle):
    """Only near-tie rows are held (collect.HeldRouting): every decisive row is the engine's own routing,
    so a wrong router that reports the held ids as its choice still fails at a topk_ids tap."""
    v = verify(near_tie_bundle[0], engine=EchoingWrongRouter())
    failed = [c.name for c in v.checks if c.status == "fail"]
    assert v.exit_code != ExitCode.OK, failed
    assert any(n.endswith("/topk_ids") for n in failed), failed


def test_a_cost_aware_engine_passes_with_its_cut_rounds_after_the_near_tie_left_unjudged(near_tie_bundle):
    """The cost-aware reference (its trees cut, docs/ddtree.md §3a) on the near-tie bundle: a cut round that
    commits tokens the near-tie routing row may move is counted `after_routing_tie`, as an uncut one is."""
    from bench.bench_budget_policy import K26_4K
    from conformance.engines.reference_engine import CostAwareReference
    v = verify(near_tie_bundle[0], engine=CostAwareReference(K26_4K))
    assert v.exit_code == ExitCode.OK, not_passed(v)[:5]
    trees = next(c for c in v.checks if c.name == f"p{PROMPT}/{LIVE}/trees")
    print(f"\ncost-aware on the near-tie bundle: {trees.metrics}")
    assert trees.metrics["pruned"] >= 1 and trees.metrics["after_routing_tie"] >= 1, trees.metrics
