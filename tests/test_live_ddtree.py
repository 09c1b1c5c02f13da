"""The live DDTree protocol (`ddtree_generate`): the reference engine's own drafter and trees judged against
the goldens (conformance/verify/judge_live.py), near-ties of the golden drafter (conformance/verify/tree_ties.py), a
planted tree-builder fault, determinism, and the records in a run dump."""
import io
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from conformance.engines.faults import FaultyEngine
from conformance.engines.protocol import check_engine
from conformance.engines.reference_engine import ReferenceEngine
from conformance.exit_codes import ExitCode
from conformance.records import read_dump, write_dump
from conformance.report.console import print_console
from conformance.tolerance import DerivedTolerance
from conformance.verify.outputs import LIVE, LIVE_RECORDS
from conformance.verify.runner import verify
from conformance.verify.tree_ties import first_difference, log_probs
from kdtr_format import open_kdtr

COMMITTED = Path(__file__).resolve().parents[1] / "bundles" / "model_tiny.kdtr"


def _live(v, what: str) -> list:
    return [c for c in v.checks if f"/{LIVE}/" in c.name and c.name.endswith("/" + what)]


@pytest.fixture(scope="module")
def live_dump(small_bundle, tmp_path_factory):
    """The reference engine's verdict and saved run dump (with the live records) on the small bundle."""
    path = tmp_path_factory.mktemp("live") / "run.kdtr"
    return verify(small_bundle, engine=ReferenceEngine(), save_dump=str(path)), path


def test_reference_engine_passes_live_and_the_dump_holds_the_records(small_bundle, live_dump):
    v, path = live_dump
    assert v.exit_code == ExitCode.OK, [c.message for c in v.checks if c.status != "pass"]
    for what in ("tokens", "tokens_vs_own_ar", "trees", "target_forwards", "path_logits"):
        assert len(_live(v, what)) == v.info["prompts"] and all(c.status == "pass" for c in _live(v, what)), what
    out, _ = read_dump(str(path))
    assert {f"p0/{LIVE}/{k}" for k in LIVE_RECORDS} <= set(out)
    again = verify(small_bundle, dump=str(path))                        # the dump is judged the same way
    assert again.exit_code == ExitCode.OK
    assert [c.name for c in again.checks if f"/{LIVE}/" in c.name] == [
        c.name for c in v.checks if f"/{LIVE}/" in c.name]


def test_reference_engine_passes_live_on_the_committed_bundle():
    """The CPU proof on the distilled drafter: streams exact, every tree golden or a near-tie of the golden
    drafter (each listed with a gap within its bound), forward counts equal where every tree is golden."""
    v = verify(str(COMMITTED), engine=ReferenceEngine())
    assert v.exit_code == ExitCode.OK, [c.message for c in v.checks if c.status != "pass"]
    trees = _live(v, "trees")
    assert len(trees) == v.info["prompts"]
    for c in trees:
        assert c.metrics["compared"] >= 1 and c.metrics["equal"] + len(c.metrics["near_ties"]) == c.metrics["compared"]
        assert all(t["gap"] <= t["bound"] for t in c.metrics["near_ties"])
    for c in _live(v, "target_forwards"):
        assert c.metrics["engine"] < c.metrics["ar_forwards"] / 3       # its own drafter really drafts
    buf = io.StringIO()
    print_console(v, Console(file=buf, width=200, color_system=None))
    e, g = (sum(c.metrics[k] for c in _live(v, "target_forwards")) for k in ("engine", "golden"))
    assert f"live DDTree: {e} target forwards for {len(trees)} prompts, golden {g}, AR " in buf.getvalue()
    for c in trees:                                                     # every allowed near-tie is printed
        if c.metrics["near_ties"]:
            assert f"ddtree note {c.name}: {c.message}" in buf.getvalue()


def test_planted_tree_builder_fault_fails_exit_4_naming_the_round(small_bundle):
    v = verify(small_bundle, engine=FaultyEngine("draft_row_shift", round=1))
    assert v.exit_code == ExitCode.DDTREE
    bad = [c for c in v.checks if c.status == "fail" and not c.name.endswith("/long_position")]
    assert len(bad) == v.info["prompts"]                                # the replay and the streams pass
    assert all(c.name.endswith(f"/{LIVE}/trees") for c in bad)
    assert all(c.message.startswith("round 1: (golden round 1,") and "decisive" in c.message for c in bad)


def test_a_ddtree_generate_that_is_not_a_method_is_named():
    e = ReferenceEngine()
    e.ddtree_generate = 3
    assert check_engine(e) == ["ddtree_generate is present but not a method"]


def test_two_live_runs_are_identical():
    """Determinism: the same records, bit for bit, from two engines loaded separately."""
    runs = []
    with open_kdtr(COMMITTED) as f:
        prompt = np.asarray(f["golden/p1/prompt_ids"])
        for _ in range(2):
            e = ReferenceEngine()
            e.load(f)
            runs.append(e.ddtree_generate(prompt, 0, 24))
    assert set(runs[0]) == set(LIVE_RECORDS)
    for k in LIVE_RECORDS:
        assert runs[0][k].dtype == runs[1][k].dtype and np.array_equal(runs[0][k], runs[1][k]), k


# ------------------------------------------------------------------ near-ties (conformance/verify/tree_ties.py)

def _lp(rows) -> np.ndarray:
    """Log-probs [L, V] of per-depth logits rows."""
    return log_probs(np.asarray(rows, np.float64))


# Golden tree: root, node 1 = token 0 at depth 1, node 2 = token 1 at depth 1. The engine's tree has
# token 2 instead at node 2; logits 3.0 (token 1) vs 3.0 - gap (token 2).
GOLD_TOK, GOLD_PAR = np.array([-1, 0, 1]), np.array([-1, 0, 0])
ENG_TOK, ENG_PAR = np.array([-1, 0, 2]), np.array([-1, 0, 0])


@pytest.mark.parametrize("gap, delta, near", [(1e-4, 1e-4, True), (3.9e-4, 1e-4, True), (4.1e-4, 1e-4, False),
                                              (0.5, 1e-4, False)])
def test_a_difference_is_a_near_tie_only_within_twice_delta_per_differing_depth(gap, delta, near):
    lp = _lp([[5.0, 3.0, 3.0 - gap, -1.0], [0.0, 0.0, 0.0, 0.0]])
    d = first_difference(GOLD_TOK, GOLD_PAR, ENG_TOK, ENG_PAR, lp, delta)
    assert d.row == 2 and d.golden == (1,) and d.engine == (2,)
    assert d.bound == pytest.approx(4 * delta)                          # 2 delta x (1 + 1) differing depths
    rounding = 2 * float(np.spacing(np.float32(5.0)))                   # log-probs are float32, as the builder's
    assert d.gap == pytest.approx(gap, abs=rounding) and d.near_tie is near


def test_shared_leading_tokens_do_not_count_toward_the_bound():
    gold_tok, gold_par = np.array([-1, 0, 1, 2]), np.array([-1, 0, 1, 1])   # node 3 = (0, 2)
    eng_tok, eng_par = np.array([-1, 0, 1, 3]), np.array([-1, 0, 1, 1])     # node 3 = (0, 3)
    lp = _lp([[5.0, 0.0, 0.0, 0.0], [0.0, 4.0, 2.0, 2.0 - 1e-4]])
    d = first_difference(gold_tok, gold_par, eng_tok, eng_par, lp, 1e-4)
    assert d.golden == (0, 2) and d.engine == (0, 3) and d.bound == pytest.approx(4e-4) and d.near_tie


def test_equal_trees_have_no_difference_and_structural_ones_are_never_near_ties():
    lp = _lp([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    assert first_difference(GOLD_TOK, GOLD_PAR, GOLD_TOK.copy(), GOLD_PAR.copy(), lp, 1.0) is None
    short = first_difference(GOLD_TOK, GOLD_PAR, GOLD_TOK[:2], GOLD_PAR[:2], lp, 1.0)
    assert not short.near_tie and "(the budget)" in short.why
    repeat = first_difference(GOLD_TOK, GOLD_PAR, np.array([-1, 0, 0]), np.array([-1, 0, 0]), lp, 1.0)
    assert not repeat.near_tie and "repeats the prefix [0]" in repeat.why
    deep = first_difference(np.array([-1, 0, 1, 2]), np.array([-1, 0, 1, 1]),
                            np.array([-1, 0, 1, 2]), np.array([-1, 0, 1, 2]), lp, 1.0)
    assert not deep.near_tie and "beyond the draft depth 2" in deep.why


# ------------------------------------------------------------------ the records in a dump

def _rewrite(path, tmp_path, edit) -> str:
    out, dtype = read_dump(str(path))
    edit(out)
    dst = tmp_path / "edited.kdtr"
    write_dump(out, str(dst), "edited", dtype)
    return str(dst)


def test_a_dump_missing_one_live_record_is_an_invalid_file_naming_it(small_bundle, live_dump, tmp_path):
    bad = _rewrite(live_dump[1], tmp_path, lambda o: o.pop(f"p1/{LIVE}/round_bonus"))
    v = verify(small_bundle, dump=bad)
    assert v.exit_code == ExitCode.INVALID_FILE
    assert any(f"p1/{LIVE}/round_bonus is missing" in p for c in v.checks for p in c.metrics.get("problems", []))


def test_a_dump_whose_accepted_path_is_not_the_walk_fails_naming_the_round(small_bundle, live_dump, tmp_path):
    def edit(o):                                                        # round 0's bonus: another token
        o[f"p0/{LIVE}/round_bonus"] = o[f"p0/{LIVE}/round_bonus"].copy()
        o[f"p0/{LIVE}/round_bonus"][0] = (o[f"p0/{LIVE}/round_bonus"][0] + 1) % 400
    v = verify(small_bundle, dump=_rewrite(live_dump[1], tmp_path, edit))
    bad = [c for c in v.checks if c.status == "fail"]
    assert v.exit_code == ExitCode.DDTREE and [c.name for c in bad] == [f"p0/{LIVE}/trees"]
    assert bad[0].message.startswith("round 0: accepted") and "are not the walk" in bad[0].message


def test_a_live_run_at_a_long_position_offset_decides_as_at_position_0(small_bundle):
    """RoPE is relative: the prompt at positions 196608.. gives the same stream and committed logits within
    the bundle's ar/logits tolerance; they are not bit-equal, so the offset really reached the rotations."""
    e = ReferenceEngine()
    with open_kdtr(small_bundle) as f:
        e.load(f)
        prompt = np.asarray(f["golden/p1/prompt_ids"])
        atol = DerivedTolerance.from_dict(f.metadata["tolerances"]["taps"]["ar/logits"]).rule().atol
    at0, far = e.ddtree_generate(prompt, 0, 8), e.ddtree_generate(prompt, 196608, 8)
    assert np.array_equal(at0["tokens"], far["tokens"])
    assert np.array_equal(at0["accepted_offsets"], far["accepted_offsets"])
    diff = np.abs(at0["path_logits"].astype(np.float64) - far["path_logits"])
    assert 0 < diff.max() <= atol


# ------------------------------------------------------------------ the reported counters against the records

class _MiscountingEngine(ReferenceEngine):
    """The reference engine reporting one target forward more than its rounds ran (its records unchanged)."""
    name = "miscounting"

    def ddtree_generate(self, prompt_ids, pos0, n_tokens):
        rec = super().ddtree_generate(prompt_ids, pos0, n_tokens)
        rec["counters"] = rec["counters"] + np.array([1, 0], np.int64)
        return rec


@pytest.mark.parametrize("all_golden", [True, False])
def test_counters_must_agree_with_the_records_even_when_not_every_tree_is_golden(all_golden):
    """counters[0] = 1 prefill + one verify per round, whatever the trees were: judged against the records
    even when (not every tree golden) the count is not judged against the golden one."""
    from conformance.verify.context import Prompt, Run
    from conformance.verify.judge_live import _forwards_check

    with open_kdtr(COMMITTED) as f:
        e = ReferenceEngine()
        e.load(f)
        rec = e.ddtree_generate(np.asarray(f["golden/p1/prompt_ids"]), 0, len(f["golden/p1/ar/tokens"]))
        p = f"p1/{LIVE}/"
        R = len(rec["accepted_offsets"]) - 1
        out = {p + k: v for k, v in rec.items()}
        pr = Prompt.of(Run.of(f), 1)
        ok = _forwards_check(pr, out, all_golden)
        assert ok.status == "pass" and list(rec["counters"]) == [1 + R, R], ok.message
        out[p + "counters"] = rec["counters"] + np.array([1, 0], np.int64)
        bad = _forwards_check(pr, out, all_golden)
    assert bad.status == "fail" and bad.message == (f"counters [{R + 2}, {R}] disagree with the {R} rounds the "
                                                    f"records hold: expected [{R + 1}, {R}] (1 prefill + one "
                                                    f"verify forward per round)")


def test_an_engine_miscounting_its_forwards_fails_the_live_target_forwards(small_bundle):
    v = verify(small_bundle, engine=_MiscountingEngine())
    bad = [c for c in v.checks if c.status == "fail" and not c.name.endswith("/long_position")]   # its summary
    assert v.exit_code == ExitCode.DDTREE and {c.name for c in bad} == {
        f"p{i}/{LIVE}/target_forwards" for i in range(v.info["prompts"])}
    assert all(" disagree with the " in c.message for c in bad)
