"""Sharded runs judged rank by rank (docs/run-dump.md §7): kdtr's sharded PyTorch DeepseekV3, one process per
rank over gloo: the correct runs on the committed shardable bundle (bundles/model_shardable_int4.kdtr), the planted
faults and refusals on a small shardable bundle made in the session (tests/conftest.py).

- TP 2 and 4, EP 2 and 4 and TP 2 x EP 2 pass every check, nothing skipped, the replicated records the same
  bits on every rank; each rank dump holds its shard (rank 1's q: its heads only);
- each planted sharding fault fails (exit 1 or 3) with the layer, tap and rank(s) of its first divergence;
- `--dump-dir` over the rank dumps a live run wrote gives the live run's verdict, check by check;
- a rank whose copy of a replicated record differs is named as diverging from the others;
- rank dumps that do not fit together are invalid files (exit 5); options that cannot apply are usage
  errors (exit 2); a model that does not divide over the ranks is an engine error (exit 6) naming the field.
"""
import json
import shutil
from pathlib import Path

import numpy as np

import pytest
from click.testing import CliRunner

from cli.main import main
from conformance.exit_codes import ExitCode
from conformance.records import write_dump
from conformance.shard_plan import ShardError, ShardFault, ShardPlan, rows_of
from conformance.verify.judge_ranks import read_dump_dir
from conformance.verify.runner import verify
from conformance.verify.shard_run import ShardedTorchEngine
from kdtr_format import open_kdtr
from refmodel.config import PRESETS

PLANS = [(2, 1), (4, 1), (1, 2), (1, 4), (2, 2)]


def run(bundle, folder, tp, ep, fault=None):
    return verify(bundle, engine=ShardedTorchEngine(tp, ep, fault), save_dump_dir=str(folder))


def summary(v) -> list:
    """What a verdict says, check by check: comparable between a live run and its rank dumps."""
    d = v.first_divergence
    return [(c.name, c.status, c.message) for c in v.checks] + [
        int(v.exit_code), None if d is None else (d.name, d.layer, d.tap, d.step, d.ranks)]


class Runs(dict):
    """(tp, ep) -> (verdict, rank-dump folder) of a correct run, each made once, when first asked for."""

    def __init__(self, bundle, tmp_path_factory):
        super().__init__()
        self.bundle, self.tmp = bundle, tmp_path_factory

    def __missing__(self, plan):
        folder = self.tmp.mktemp("tp{}ep{}".format(*plan))
        self[plan] = run(self.bundle, folder, *plan), folder
        return self[plan]


COMMITTED = str(Path(__file__).resolve().parent.parent / "bundles" / "model_shardable_int4.kdtr")


@pytest.fixture(scope="module")
def passing_bundle():
    """The committed shardable bundle (bundles/MANIFEST.md): the correct plans run on it, and the tests that
    reuse their rank dumps judge them against it."""
    return COMMITTED


@pytest.fixture(scope="module")
def passing(passing_bundle, tmp_path_factory):
    return Runs(passing_bundle, tmp_path_factory)


@pytest.mark.parametrize("tp,ep", PLANS)
def test_sharded_plans_pass_the_committed_shardable_bundle(passing, passing_bundle, tp, ep):
    v, folder = passing[(tp, ep)]
    bad = [(c.name, c.status, c.message) for c in v.checks if c.status != "pass" and "/ddtree_live/" not in c.name]
    assert v.exit_code == ExitCode.OK and not bad, bad[:5]
    live = [c for c in v.checks if "/ddtree_live/" in c.name]          # no DDTree loop of its own: not run
    assert live and all(c.status == "skip" for c in live)
    assert v.coverage["total"]["run"] == v.coverage["total"]["defined"] - len(live)
    assert [d["step"] for d in v.done_by_kdtr] == ["ddtree_loop"]
    assert v.info["shard"] == {"world_size": max(tp, ep), "tp": tp, "ep": ep,
                               "replicated_copies": "the same bits on every rank"}
    outs, metas, dtype, _ = read_dump_dir(str(folder))
    cfg = PRESETS["shardable"]
    assert [m["rank"] for m in metas] == list(range(max(tp, ep))) and dtype == "float32"
    q = outs[1]["p1/prefill/L0/q"]                                       # prompt 1: 5 tokens
    assert q.shape == (5, cfg.num_attention_heads // tp, cfg.qk_head_dim)
    scores = outs[1]["p1/prefill/L1/router_scores"]
    assert scores.shape == (5, cfg.n_routed_experts // ep)
    rows = rows_of(5, max(tp, ep), 1)
    assert outs[1]["p1/prefill/L1/mlp_out"].shape[0] == (rows[1] - rows[0] if ep > 1 else 5)


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)])
def test_dump_dir_gives_the_live_verdict(passing, passing_bundle, tp, ep):
    v, folder = passing[(tp, ep)]
    assert summary(verify(passing_bundle, dump_dir=str(folder))) == summary(v)


def _first_expert(bundle, layer: int) -> int:
    with open_kdtr(bundle) as f:
        return int(f[f"golden/p0/prefill/L{layer}/topk_ids"][0, 0])


# fault, plan, expected first divergence (name, layer, tap), its ranks
FAULTS = {
    "no_allreduce": (dict(layer=2), (2, 1), "p0/prefill/L2/attn_out", [0, 1]),
    "head_stride": (dict(rank=1), (2, 1), "p0/prefill/L0/q", [1]),
    "expert_wrong_rank": (dict(layer=1), (1, 2), "p0/prefill/L1/mlp_out", [0]),
    # prompt 0 has one token (rank 0's), so rank 1's combine first runs on prompt 1's rows 3 and 4
    "combine_twice": (dict(layer=2, rank=1), (1, 2), "p1/prefill/L2/mlp_out", [1]),
    "shared_every_rank": (dict(layer=3), (2, 1), "p0/prefill/L3/mlp_out", [0, 1]),
}


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_planted_sharding_faults_name_layer_tap_and_rank(shardable_bundle, tmp_path, name):
    where, (tp, ep), first, ranks = FAULTS[name]
    if name == "expert_wrong_rank":                                      # an expert prompt 0's token uses
        where = dict(where, expert=_first_expert(shardable_bundle, where["layer"]))
    v = run(shardable_bundle, tmp_path, tp, ep, ShardFault(name, **where))
    d = v.first_divergence
    assert v.exit_code in (ExitCode.NUMERIC, ExitCode.TOKENS), [c.message for c in v.checks if c.status == "error"]
    assert (d.name, d.layer, d.tap, d.ranks) == (first, int(first.split("/")[2][1:]), first.split("/")[-1], ranks)
    c = next(c for c in v.checks if c.name == first)
    assert c.status == "fail" and c.metrics["ranks"] == ranks and f"rank(s) {ranks}" in c.message
    assert summary(verify(shardable_bundle, dump_dir=str(tmp_path))) == summary(v)


def test_a_rank_whose_replicated_copy_differs_diverges_from_the_others(passing, passing_bundle, tmp_path):
    _, folder = passing[(2, 1)]
    outs, metas, _, _ = read_dump_dir(str(folder))
    shutil.copy(folder / "rank0.kdtr", tmp_path / "rank0.kdtr")
    bad = dict(outs[1])
    bad["p1/prefill/L3/attn_out"] = bad["p1/prefill/L3/attn_out"].copy()
    bad["p1/prefill/L3/attn_out"][2, 7] += 1e-2                         # far over its tolerance (~1e-4)
    write_dump(bad, str(tmp_path / "rank1.kdtr"), "torch", "float32", routing="free", shard=metas[1])
    v = verify(passing_bundle, dump_dir=str(tmp_path))
    d = v.first_divergence
    assert v.exit_code == ExitCode.NUMERIC and (d.name, d.ranks) == ("p1/prefill/L3/attn_out", [1])
    c = next(c for c in v.checks if c.name == d.name)
    assert "rank(s) [1] diverge from rank(s) [0]" in c.message
    assert v.info["shard"]["replicated_copies"] == "2 distinct sets: ranks [[0], [1]]"


def _rewrite(src, dst, r, change):
    outs, metas, _, _ = read_dump_dir(str(src))
    out, meta = change(dict(outs[r]), dict(metas[r]))
    write_dump(out, str(dst / f"rank{r}.kdtr"), "torch", "float32", routing="free", shard=meta)


@pytest.mark.parametrize("case,expect", [
    ("missing rank", "rank0.kdtr .. rank{W-1}.kdtr"),
    ("wrong world size", "of world size 3"),
    ("heads not tiling", "must tile [0, 16) in rank order"),
    ("shard of the wrong shape", "rank 1 holds shape"),
])
def test_rank_dumps_that_do_not_fit_are_invalid(passing, passing_bundle, tmp_path, case, expect):
    _, folder = passing[(2, 1)]
    shutil.copy(folder / "rank0.kdtr", tmp_path / "rank0.kdtr")
    if case == "missing rank":
        shutil.copy(folder / "rank1.kdtr", tmp_path / "rank2.kdtr")
    elif case == "wrong world size":
        _rewrite(folder, tmp_path, 1, lambda o, m: (o, dict(m, world_size=3)))
    elif case == "heads not tiling":
        def shifted(m):                                                  # rank 1's heads of L2 start at 7
            return {k: (dict(e, start=e["start"] - 1) if k == "L2/q" else e) for k, e in m["records"].items()}
        _rewrite(folder, tmp_path, 1, lambda o, m: (o, dict(m, records=shifted(m))))
    else:
        _rewrite(folder, tmp_path, 1, lambda o, m: (dict(o, **{"p1/prefill/L0/q": o["p1/prefill/L0/q"][:, :4]}), m))
    v = verify(passing_bundle, dump_dir=str(tmp_path))
    assert v.exit_code == ExitCode.INVALID_FILE
    text = " ".join(c.message + " ".join(c.metrics.get("problems", [])) for c in v.checks)
    assert expect in text, text[:400]


def test_the_plan():
    cfg = PRESETS["shardable"]
    assert [rows_of(5, 2, r) for r in range(2)] == [(0, 3), (3, 5)]
    assert [rows_of(1, 4, r) for r in range(4)] == [(0, 1), (1, 1), (1, 1), (1, 1)]
    m = ShardPlan(4, 4).metadata(cfg, 2)
    assert (m["rank"], m["world_size"], m["records"]["L0/q"]) == (2, 4, {"split": "heads", "start": 8, "stop": 12})
    assert m["records"]["L1/router_scores"] == {"split": "experts", "start": 16, "stop": 24}
    assert m["records"]["L1/mlp_out"] == {"split": "rows"} and "L0/mlp_out" not in m["records"]
    for W in (2, 4, 8):
        ShardPlan(W, W).check(cfg)
    with pytest.raises(ShardError, match="num_attention_heads = 6 does not divide over 4 ranks"):
        ShardPlan(4, 1).check(PRESETS["tiny"])
    with pytest.raises(ShardError, match="--tp and --ep are each 1 or the world size"):
        ShardPlan(2, 4)
    with pytest.raises(ShardError, match="fault head_stride needs --tp > 1"):
        ShardFault("head_stride", rank=1).check(ShardPlan(1, 2))


@pytest.mark.parametrize("args,expect", [
    (["--tp", "2"], "pass --engine torch"),
    (["--engine", "torch", "--tp", "2", "--dtype", "bfloat16"], "drop --dtype bfloat16"),
    (["--engine", "torch", "--tp", "2", "--save-dump", "x.kdtr"], "use --save-dump-dir"),
    (["--engine", "torch", "--tp", "2", "--ep", "4"], "--tp and --ep are each 1 or the world size"),
    (["--save-dump-dir", "d"], "give --tp or --ep"),
])
def test_sharded_options_that_cannot_apply_are_usage_errors(shardable_bundle, args, expect):
    r = CliRunner().invoke(main, ["verify", str(shardable_bundle)] + args)
    assert r.exit_code == ExitCode.USAGE and expect in " ".join(r.output.split()), r.output


@pytest.mark.parametrize("extra,expect", [(["--tp", "2"], "drop --tp"),
                                          (["--save-dump-dir", "d"], "drop --save-dump/--save-dump-dir")])
def test_dump_dir_refuses_engine_options(shardable_bundle, tmp_path, extra, expect):
    r = CliRunner().invoke(main, ["verify", str(shardable_bundle), "--dump-dir", str(tmp_path)] + extra)
    assert r.exit_code == ExitCode.USAGE and expect in " ".join(r.output.split()), r.output


def test_a_model_that_does_not_divide_is_an_engine_error_naming_the_field(small_int4_bundle):
    r = CliRunner().invoke(main, ["verify", str(small_int4_bundle), "--engine", "torch", "--tp", "4"])
    assert r.exit_code == ExitCode.ENGINE_ERROR, r.output
    assert "num_attention_heads = 6 does not divide over 4 ranks" in " ".join(r.output.split()), r.output


def test_group_gaps_bound_the_group_limited_decision():
    """Moving every biased score by less than half the row's gap (as for the ungrouped gap: a flip needs an
    error above half of it, the rule kdtr gen rejects prompts by) never changes a group-limited top-8 set;
    moving them by more can."""
    from conformance.gen.goldens import group_gaps
    from refmodel.model import select_experts

    cfg = PRESETS["shardable"]
    rng = np.random.default_rng(0)
    choice = rng.uniform(0, 1, (400, cfg.n_routed_experts))
    gaps = group_gaps(cfg, choice)
    sets = np.sort(select_experts(cfg, choice), -1)
    flipped = 0
    for scale, may_flip in ((0.4999, False), (3.0, True)):
        noise = rng.uniform(-1, 1, choice.shape) * gaps[:, None] * scale
        moved = np.any(np.sort(select_experts(cfg, choice + noise), -1) != sets, axis=-1)
        assert may_flip or not moved.any(), np.nonzero(moved)[0][:5]
        flipped += int(moved.sum())
    assert flipped > 0                                                   # the bound is not vacuous
    from conformance.metrics import routing_gaps                         # the plain K-th vs (K+1)-th gap
    plain = routing_gaps(choice, cfg.num_experts_per_tok)                # is no bound here: it flips sets
    noise = rng.uniform(-1, 1, choice.shape) * plain[:, None] * 0.4999
    assert np.any(np.sort(select_experts(cfg, choice + noise), -1) != sets)


def test_cli_dump_dir_over_a_sharded_run(passing, passing_bundle, tmp_path):
    _, folder = passing[(2, 1)]
    report = tmp_path / "r.json"
    r = CliRunner().invoke(main, ["verify", str(passing_bundle), "--dump-dir", str(folder), "--json", str(report)])
    text = " ".join(r.output.split())
    assert r.exit_code == ExitCode.OK and "ranks: 2 (tp 2, ep 1); replicated records: the same bits on every rank" \
        in text, r.output
    assert json.loads(report.read_text())["verdict"] == "pass"
