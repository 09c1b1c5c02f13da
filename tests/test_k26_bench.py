"""`kdtr bench ddtree --k26` (bench/k26_ddtree*.py): the host half against independent computations on CPU;
the device half itself on a GPU (cuda-marked; no fake driver stands in for it here: the device half ran on
the H200, docs/k26-scale.md)."""
import math
from pathlib import Path

import numpy as np
import pytest

from bench import k26_ddtree as k
from bench import k26_ddtree_report as rp
from cuda_oracle import committed_bundles

BUNDLES = committed_bundles()


@pytest.fixture(scope="module")
def rounds():
    return k.golden_rounds(BUNDLES)


# ---------------------------------------------------------------- tree shapes and the bundles' acceptance

def _walk(r: dict, b: int) -> int:
    """Accepted depth of round r's tree cut to its first b nodes, by the greedy walk over the golden target
    argmax (the child whose token the target chose, among nodes 1..b)."""
    node, depth = 0, 0
    while True:
        kids = [c for c in range(1, min(b, len(r["parents"]) - 1) + 1)
                if r["parents"][c] == node and r["tokens"][c] == r["verify_argmax"][node]]
        if not kids:
            return depth
        node, depth = kids[0], depth + 1


def test_accepted_depth_at_budget_is_the_walk_of_the_cut_tree(rounds):
    assert len(rounds) > 20
    for r in rounds:
        assert k.accepted_depth_at(r["accepted"], r["budget"]) == r["accepted_depth"] == _walk(r, r["budget"])
        for b in (1, 2, 3, 5, 8, 13, 21, 31):
            assert k.accepted_depth_at(r["accepted"], b) == _walk(r, b), (r["bundle"], r["prompt"], r["round"], b)


def test_bundle_acceptance_is_the_mean_tokens_per_round_and_none_beyond_the_budget(rounds):
    acc = k.bundle_acceptance(rounds, (1, 32, 48))
    assert acc[32] == pytest.approx(np.mean([1 + r["accepted_depth"] for r in rounds]))
    assert acc[1] == pytest.approx(np.mean([1 + _walk(r, 1) for r in rounds]))
    assert acc[48] is None


def test_tree_shapes_are_golden_prefixes_then_grafted_trees(rounds):
    first = rounds[0]["parents"]
    for b in (1, 7, 32):
        p, synth = k.tree_shape(rounds, b)
        assert p.tolist() == first[:b + 1].tolist() and not synth
    p, synth = k.tree_shape(rounds, 64)
    assert synth and len(p) == 65 and p[0] == -1 and all(0 <= p[i] < i for i in range(1, 65))
    depth = k._depths(first)
    assert p[33] == int(np.argmax(depth)) and depth[p[33]] == depth.max()   # the graft hangs off a deepest node


def test_tree_mask_sees_the_cache_and_exactly_the_ancestors():
    parents = np.array([-1, 0, 0, 1, 3, 2])
    m = k.tree_mask(parents, 3)
    assert m.shape == (6, 9) and (m[:, :3] == 0).all()
    for i in range(6):
        anc, j = {i}, i
        while parents[j] >= 0:
            j = parents[j]
            anc.add(j)
        assert {c for c in range(6) if m[i, 3 + c] == 0} == anc
        assert np.isneginf(m[i, 3:][[c for c in range(6) if c not in anc]]).all()


# ---------------------------------------------------------------- routing models and bytes

def test_independent_distinct_formula_matches_sampling_and_an_exact_case():
    assert k.independent_distinct(2, E=2, K=1) == pytest.approx(1.5)      # 1 or 2 experts, each w.p. 1/2
    rng = np.random.default_rng(3)
    for N in (1, 9, 33):
        got = np.mean([np.unique(np.concatenate([rng.choice(384, 8, replace=False) for _ in range(N)])).size
                       for _ in range(300)])
        assert got == pytest.approx(k.independent_distinct(N), abs=1.5)


def test_route_tree_model():
    parents, _ = k.tree_shape(k.golden_rounds(BUNDLES[:1]), 32)
    rng = np.random.default_rng(0)
    ids = k.route_tree(parents, 1.0, rng)
    assert ids.shape == (33, 8) and k.distinct_experts(ids) == 8               # share 1: all as the root
    for share in (0.0, 0.5):
        ids = k.route_tree(parents, share, rng)
        assert all(len(set(row)) == 8 for row in ids) and ids.min() >= 0 and ids.max() < 384
    kept = [len(set(c) & set(p)) / 8 for _ in range(40) for ids in [k.route_tree(parents, 0.5, rng)]
            for c, p in zip(ids[1:], ids[parents[1:]])]
    assert np.mean(kept) == pytest.approx(0.5, abs=0.05)                        # + ~1% chance re-picks
    assert k.mean_distinct(parents, 0.0, samples=200) == pytest.approx(k.independent_distinct(33), abs=2.0)


def test_expert_and_dense_bytes_from_the_model_shapes():
    from refmodel.config import PRESETS
    from refmodel.weights import expected_shapes

    D, I = 7168, 2048
    assert k.expert_bytes() == 3 * D * I // 2 + 3 * D * I // 32 * 2            # INT4 + a bf16 scale per 32
    shapes = expected_shapes(PRESETS["k26"])
    p = "model.layers.1."
    names = ["self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", "self_attn.q_b_proj.weight",
             "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight", "mlp.gate.weight"]
    assert k.dense_bytes() == 2 * sum(math.prod(shapes[p + n]) for n in names)      # bf16, as K2.6 stores them
    assert k.dense_bytes(dense="float32") == 2 * k.dense_bytes()
    assert k.cache_bytes(10) == 10 * 576 * 4


# ---------------------------------------------------------------- published acceptance, projection

def test_fit_alpha_inverts_the_chain():
    a = k.fit_alpha(5.3, 7)
    assert k.chain_tau(a, 7) == pytest.approx(5.3, abs=1e-9)
    assert k.chain_tau(a, 7) == pytest.approx((1 - a ** 8) / (1 - a))
    with pytest.raises(ValueError, match="tau 9 must lie in"):
        k.fit_alpha(9, 7)


def test_tree_tau_is_the_sum_of_the_best_nodes_by_brute_force():
    ranks, depth = 16, 3
    for alpha in (0.3, 0.7, 0.9):
        p = [alpha * (1 - alpha) ** r for r in range(ranks)]
        q = sorted((math.prod(p[r] for r in path) for d in range(1, depth + 1)
                    for path in np.ndindex(*(ranks,) * d)), reverse=True)
        for b in (1, 2, 5, 17, 40):
            assert k.tree_tau(alpha, b, depth, ranks) == pytest.approx(1 + sum(q[:b]))
    a = k.fit_alpha(5.3, 7)
    assert k.tree_tau(a, 7, 7) == pytest.approx(5.3)              # 7 nodes: the published chain itself
    pub = k.published_acceptance((1, 8, 64), 5.3)
    assert pub[1] < pub[8] < pub[64] <= 8


def test_project_and_best_budget():
    s = k.project({1: 1.2, 2: 1.5, 4: 3.0, 8: None}, {1: 1.8, 2: 2.4, 4: 3.3, 8: 5.0})
    assert s == {1: pytest.approx(1.5), 2: pytest.approx(1.6), 4: pytest.approx(1.1), 8: None}
    assert k.best_budget(s) == (2, pytest.approx(1.6))
    assert k.project({1: 1.0}, {1: 2.0}, draft=1.0) == {1: pytest.approx(1.0)}
    assert k.best_budget({1: 2.0, 4: 2.0}) == (1, 2.0) and k.best_budget({1: None}) == (None, None)


def _fake_gpu(budgets=(1, 2)) -> dict:
    ms = []
    for l in range(2):
        ms.append({"layer": l, "context": 4096, "routing": "ar", "budget": 0, "rows": 1, "us_layer": 100.0 + l,
                   "us_moe": 60.0, "distinct_routed": 8, "error": None})
        for b in budgets:
            for routing, us in (("router", 100.0 * (1 + b)), ("correlated", 50.0 * (2 + b))):
                ms.append({"layer": l, "context": 4096, "routing": routing, "budget": b, "rows": b + 1,
                           "us_layer": us + l, "us_moe": us / 2, "us_mla": us / 4 + l, "distinct_routed": 8 * (b + 1),
                           "error": None})
    ms.append({"layer": 1, "context": 32768, "routing": "ar", "budget": 0, "rows": 1, "us_layer": None,
               "us_moe": None, "distinct_routed": None, "error": "skipped: past the time budget"})
    ms.append({"layer": 1, "context": 32768, "routing": "router", "budget": 1, "rows": 2, "us_layer": 5.0,
               "us_moe": None, "distinct_routed": None, "error": "RuntimeError: read back failed"})
    return {"device": "fake", "layers": 2, "reps": 5, "share": 0.5, "contexts": [4096, 32768], "copy_gbps": 4000.0,
            "measurements": ms, "skipped": 1, "elapsed_s": 1.0}


def test_summary_projection_and_table_of_a_device_result(rounds):
    import json

    shapes = {b: k.tree_shape(rounds, b)[0] for b in (1, 2)}
    acc = rp.acceptance_models(rounds, (1, 2))
    r = rp.report(rounds, shapes, {1: False, 2: False}, acc, rp.routing_table(shapes, samples=8), _fake_gpu())
    json.dumps(r)                                                          # JSON-ready as it is
    router = {s["budget"]: s for s in r["summary"] if s["routing"] == "router"}
    assert router[2]["us_layer"] == pytest.approx(300.5) and router[2]["ar_us"] == pytest.approx(100.5)
    assert router[2]["verify_over_ar"] == pytest.approx(300.5 / 100.5)
    assert router[1]["us_attention"] == pytest.approx(200.5 - 100.0)
    assert router[1]["us_mla"] == pytest.approx(50.5)                    # the MLA launches' mean over the layers
    assert [x["us_mla"] for x in r["summary"] if x["routing"] == "ar"] == [None]   # not measured there: empty
    assert router[2]["bytes"] == pytest.approx(k.layer_bytes(24, 3, 4096, "float32"))   # a run without "dense"
    bf = rp.report(rounds, shapes, {1: False, 2: False}, acc, r["routing_model"], {**_fake_gpu(), "dense": "bf16"})
    bf_router = {s["budget"]: s for s in bf["summary"] if s["routing"] == "router"}
    assert router[2]["bytes"] - bf_router[2]["bytes"] == pytest.approx(k.dense_bytes())   # half of float32's
    assert bf["dense_bytes"] == k.dense_bytes() and r["dense_bytes"] == k.dense_bytes(dense="float32")
    assert router[2]["moe_over_floor"] == pytest.approx(150.0 / (25 * k.expert_bytes() / 4000.0 / 1e3))
    aim = {(a["aim"].split(", ")[2], a["aim"].split(", ")[3]): a for a in r["aims"]}
    pg = next(p for p in r["projection"] if p["routing"] == "router" and p["acceptance"] == "published GSM8K")
    assert aim[("4096 cached rows", "router routing")]["value"] == pg["best_speedup"]
    assert aim[("4096 cached rows", "router routing")]["met"] == (pg["best_speedup"] >= 1.5)
    assert not aim[("4096 cached rows", "router routing")]["on_aim_card"]          # the fake device is no H200
    tau = acc["published GSM8K"]["tau"]
    room = max(tau[b] / 1.5 - router[b]["verify_over_ar"] for b in (1, 2))
    assert aim[("4096 cached rows", "router routing")]["draft_room_ar_steps"] == pytest.approx(room)
    assert k.project({b: router[b]["verify_over_ar"] for b in (1, 2)}, tau, draft=room)[
        max((1, 2), key=lambda b: tau[b] / 1.5 - router[b]["verify_over_ar"])] == pytest.approx(1.5)
    p = next(p for p in r["projection"] if p["routing"] == "correlated" and p["acceptance"] == "bundles")
    ratio = {b: (50.0 * (2 + b) + 0.5) / 100.5 for b in (1, 2)}
    assert p["speedup"]["2"] == pytest.approx(acc["bundles"]["tau"][2] / ratio[2])
    assert p["best_budget"] == max((1, 2), key=lambda b: acc["bundles"]["tau"][b] / ratio[b])
    assert {x["context"] for x in r["summary"]} == {4096}                 # 32K: nothing ran, no rows
    bb = next(x for x in r["bytes_bound"] if x["share"] == "0.5" and x["acceptance"] == "published GSM8K")
    ratio_b = {x["budget"]: x["bytes_over_ar_at_share"]["0.5"] for x in r["routing_model"]}
    assert bb["speedup"]["2"] == pytest.approx(acc["published GSM8K"]["tau"][2] / ratio_b[2])
    text = rp.table(r)
    assert "verify/AR" in text and f"b={p['best_budget']}" in text and "published GSM8K" in text
    assert "MLA us" in text and f"{router[1]['us_mla']:9.1f}" in text
    assert f"(bundles: {acc['bundles']['source']})" in text              # which bundles the row's tau came from


def test_cli_host_half_writes_the_json(tmp_path):
    import json

    from click.testing import CliRunner

    from cli.main import main

    out = tmp_path / "k26.json"
    res = CliRunner().invoke(main, ["bench", "ddtree", "--k26", "--k26-quick", "--no-device", "--json", str(out)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert r["budgets"] == list(k.QUICK_BUDGETS) and r["gpu"] is None and "tokens per round" in res.output
    assert r["acceptance"]["bundles"]["tau"]["64"] is None
    # the default bundles: every committed one but the slices (an untrained drafter's acceptance is no drafter's)
    root = Path(__file__).resolve().parent.parent / "bundles"
    from kdtr_format import open_kdtr

    slices = set()
    for b in root.glob("*.kdtr"):
        with open_kdtr(b) as f:
            if "slice" in f.metadata:
                slices.add(b.name)
    assert "model_tiny_slice.kdtr" in slices                            # so the default has one to leave out
    used = sorted(b.name for b in root.glob("*.kdtr") if b.name not in slices)
    assert len(used) >= 5
    source = r["acceptance"]["bundles"]["source"]
    assert f"of {len(used)} bundles ({', '.join(used)})" in source and "model_tiny_slice" not in source, source


# ---------------------------------------------------------------- on a GPU

@pytest.mark.cuda
def test_device_half_on_the_gpu(rounds):
    from cuda_oracle import gpu_ops

    gpu_ops()                                            # skips without pycuda / a device
    from bench import k26_ddtree_gpu as g

    shapes = {b: k.tree_shape(rounds, b)[0] for b in (1, 16)}
    res = g.measure(shapes, (4096,), layers=1, reps=2, progress=lambda m: None)
    ms = res["measurements"]
    assert [m["error"] for m in ms] == [None] * 5
    ar = ms[0]
    assert ar["routing"] == "ar" and ar["distinct_routed"] == 8 and ar["us_layer"] > 0 and ar["us_moe"] > 0
    corr = [m for m in ms if m["routing"] == "correlated" and m["budget"] == 16][0]
    assert 8 <= corr["distinct_routed"] <= 8 * 17


def test_the_kdtr_script_finds_bench_from_any_directory(tmp_path):
    """`kdtr bench ddtree --k26` through the installed `kdtr` script, started outside the repository: bench/ is
    not installed and the script does not put the working directory on the import path, so the command finds
    the clone's bench/ beside cli/ (it failed with "No module named 'bench'" before)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).parent / "kdtr"
    if not script.exists():
        pytest.skip("no installed kdtr script beside this Python")
    bundle = Path(__file__).resolve().parent.parent / "bundles" / "model_tiny.kdtr"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(script), "bench", "ddtree", "--k26", "--no-device", "--json", str(tmp_path / "r.json"),
                          str(bundle)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "r.json").is_file() and "tokens per round (tau)" in out.stdout


@pytest.mark.parametrize("device,on_card", [("NVIDIA H200", True), ("NVIDIA H100 80GB HBM3", False), (None, False)])
def test_an_aim_measured_on_another_card_says_which(rounds, device, on_card):
    """The aims are stated for the H200: a verify / AR ratio moves with the card's memory speed, so a projection
    measured elsewhere says 'met on <card>, not on an H200' instead of a bare 'met'."""
    shapes = {b: k.tree_shape(rounds, b)[0] for b in (1, 2)}
    acc = rp.acceptance_models(rounds, (1, 2))
    gpu = {**_fake_gpu(), "device": device}
    r = rp.report(rounds, shapes, {1: False, 2: False}, acc, rp.routing_table(shapes, samples=8), gpu)
    lines = [line for line in rp.table(r).splitlines() if line.startswith("aim: ")]
    assert lines and all(a["on_aim_card"] is on_card and a["device"] == device for a in r["aims"])
    for a, line in zip(r["aims"], lines):
        verdict = "met" if a["met"] else "MISSED"
        if on_card:
            assert line.split(" -> ")[1].startswith(f"{verdict} (room")
        else:
            assert f"-> {verdict} on {device or 'an unnamed device'}, not on an H200, the card the aim is for" in line


@pytest.mark.parametrize("device,on_card", [("NVIDIA H200", True), ("NVIDIA H100 80GB HBM3", False)])
def test_the_w4a16_bench_aims_are_the_issues_and_name_the_card(device, on_card):
    """`kdtr bench w4a16`'s aims (cuda_engine/bench_w4a16.py, no GPU needed to judge them): the one-token K2.6 MoE
    layer's aim is 75% of the copy bandwidth (it said 70% until stop 48, so 72% printed 'met'), the grouped layer's
    1.6x its distinct experts' floor, and a run on a card other than the H200 says which card it was."""
    from cuda_engine.bench_w4a16 import _aims, table

    out = {"device": device, "compute_capability": "9.0", "l2_bytes": 50 * 2**20, "tinygemm": "-", "rows": [],
           "moe_layer": {"fraction_of_copy": 0.72, "slots": 9, "experts_on_device": 385, "what": "w", "us_per_token": 1.0,
                         "gbps": 1.0, "copy_gbps": 1.0, "us_gate_up": 1.0, "gbps_gate_up": 1.0, "us_down": 1.0,
                         "gbps_down": 1.0, "us_combine": 1.0},
           "moe_grouped": []}
    out["aims"] = _aims(out)
    (one,) = out["aims"]
    assert one["aim"] == "one-token K2.6 MoE layer: >= 75% of the copy bandwidth" and not one["met"]
    assert one["on_aim_card"] is on_card and one["aim_card"] == "H200"
    line = next(x for x in table(out).splitlines() if x.startswith("aim: "))
    assert line.endswith("-> MISSED" if on_card else f"-> MISSED on {device}, not on an H200, the card the aim is for")
    out["moe_layer"]["fraction_of_copy"] = 0.75
    assert _aims(out)[0]["met"]


@pytest.mark.parametrize("device,on_card", [("NVIDIA H200", True), ("NVIDIA H200 NVL", True), ("H200", True),
                                            ("NVIDIA GH200 480GB", False), ("NVIDIA H2000", False),
                                            ("NVIDIA H100 80GB HBM3", False), (None, False)])
def test_the_aims_card_is_matched_as_a_model_name(device, on_card):
    """Both benches record the card through one helper: a GH200 (another memory system) is not the H200 the aims
    are stated for, an H200 NVL is."""
    from cuda_engine.bench_w4a16 import aim_card_fields
    assert aim_card_fields(device) == {"aim_card": "H200", "device": device, "on_aim_card": on_card}
