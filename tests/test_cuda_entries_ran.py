"""Every kernel entry and planner regime the CUDA engine ships runs in at least one committed-bundle verify on
the GPU. A proof's metadata engine_info records what the engine launched during that verify (`kernels_ran`:
kernel name -> launches; `w4a16_regimes`: the fast W4A16 launches' "path:regime" -> launches;
CudaEngine.dump_metadata, cuda_engine/w4a16_plan.py), and this test compares the union over the committed proofs
with the engine's entry tables. CPU only: it reads the committed proofs, no GPU, no pycuda."""
import ast
import itertools
from pathlib import Path

import pytest

from cuda_engine.drafter import DRAFTER_SIGNATURES
from cuda_engine.ops import SIGNATURES
from cuda_engine.proofs import REPROVE, engine_info, proof_modes, proof_path
from cuda_engine.w4a16_plan import (W4A16_DIGITS_ROWS, W4A16_ENTRIES, W4A16_GROUP_TOKENS, W4A16_MOE_ROWS, W4A16_PATHS,
                                    W4A16_REGIMES, W4A16_ROWS, w4a16_launch)

from cuda_oracle import committed_bundles, moe_launches

PROOFS = [proof_path(b, m) for b in committed_bundles() for m in proof_modes(b)]
ENGINE_PY = Path(__file__).resolve().parent.parent / "cuda_engine" / "engine.py"
# The engine launches w4a16_mma on two paths only (cuda_engine/engine.py, checked below): one (token, slot) pair
# per z up to w4a16_plan.MOE_PAIRS_MAX_TOKENS tokens, and the grouped path of a larger forward on the int8 digits. On those the
# planner picks from two families at the MoE paths' row counts, whatever the shape (checked below): these are
# the entries the engine ships.
ENGINE_W4A16 = {W4A16_ROWS[1][r] for r in W4A16_MOE_ROWS} | set(W4A16_DIGITS_ROWS.values())
W4A16_ALL = ({n for table in W4A16_ENTRIES.values() for _, n in table} | set(W4A16_DIGITS_ROWS.values())
             | {n for family in W4A16_ROWS.values() for n in family.values()})
# In the kernel module but never launched by the engine: kdtr bench w4a16's floor, and every other w4a16_mma
# entry: the bf16-activation ones (no engine result is judged in those numerics), the three-bf16-terms ones
# (the linear path and the bf16 terms' grouped variant, which the benchmark and the kernel tests run; the
# engine runs the int8 digits instead, docs/cuda-engine.md) and the one-token digits of 2 and 4 row blocks
# (the linear path's, single weights)
BENCH_ONLY = {"stream_read_kernel", *(W4A16_ALL - ENGINE_W4A16)}
SHIPPED = sorted((set(SIGNATURES) | set(DRAFTER_SIGNATURES)) - BENCH_ONLY)
# The engine's fast W4A16 launches are FP32-faithful and of at most 16 tokens per z (the slot path up to 17
# tokens, the grouped path above), so their regimes are w4a16_rows_plan's of the MoE paths; "rows" (a single
# weight's), "wave" (17-64 tokens, bf16) and "forced" (a test's rows=) are not the engine's. Its paths: one
# pair per z, and groups of pairs.
ENGINE_REGIMES = [r for r in W4A16_REGIMES if r not in ("rows", "wave")]
ENGINE_PATHS = [p for p in W4A16_PATHS if p != "linear"]


def records() -> list[dict]:
    infos = [engine_info(p) for p in PROOFS]
    old = [str(p) for p, i in zip(PROOFS, infos) if "kernels_ran" not in i or "w4a16_regimes" not in i]
    if old:
        pytest.skip(f"the committed proofs predate the record of what ran (engine_info.kernels_ran and "
                    f"w4a16_regimes absent in {', '.join(old)}): {REPROVE}")
    return infos


def test_the_tables_name_real_kernels():
    """The table this test compares with is the engine's: every shipped entry is prepared by the engine (a
    name here that the module lacks would fail the engine's load on the GPU), and the bench-only set is real."""
    assert W4A16_ALL <= set(SIGNATURES) and BENCH_ONLY <= set(SIGNATURES)
    assert SHIPPED and not BENCH_ONLY & set(SHIPPED) and ENGINE_W4A16 <= set(SHIPPED)
    assert "moe_group_kernel" in SHIPPED and "w4a16_mma_t3_m16" in BENCH_ONLY


def _w4a16_calls(path: Path) -> list[dict]:
    """The keyword arguments of every `.w4a16_mma(...)` call in a source file (value: the AST node)."""
    calls = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and n.func.attr == "w4a16_mma"]
    return [{k.arg: k.value for k in c.keywords} for c in calls]


def test_the_engine_launches_w4a16_mma_only_on_its_two_paths():
    """What makes the three-bf16-terms and bf16 entries bench-only: every launch in the engine passes slot_ids
    (the pairs path) or groups with digits=True (the grouped path), never numerics= or rows=."""
    calls = _w4a16_calls(ENGINE_PY)
    assert len(calls) >= 4, "the engine's MoE paths launch w4a16_mma at least four times"
    for kw in calls:
        digits = isinstance(kw.get("digits"), ast.Constant) and kw["digits"].value is True
        assert ("slot_ids" in kw and "groups" not in kw) or ("groups" in kw and digits), sorted(kw)
        assert "numerics" not in kw and "rows" not in kw, sorted(kw)


def test_the_planner_picks_the_engines_entries_on_those_paths():
    """On the engine's two paths w4a16_launch picks from the one-token and the digits families at the MoE
    paths' row counts only, in the engine's regimes, for any launch shape and GPU size: so no bench-only entry
    or regime can run in an engine verify."""
    slot, digits = {W4A16_ROWS[1][r] for r in W4A16_MOE_ROWS}, set(W4A16_DIGITS_ROWS.values())
    for Nb, G, Z, sm, per_sm in itertools.product((1, 2, 3, 5, 9, 64, 128, 224, 300), (1, 6, 9, 16, 64, 224, 1000),
                                                  (1, 4, 8, 9, 40, 131, 132, 400), (132, 188), (1, 2, 3)):
        res = lambda name: per_sm * sm                                       # noqa: E731 - any residency
        name, _, _, regime = w4a16_launch(Nb, G, Z, None, 1, "fp32", None, False, res, sm, moe=True)
        assert name in slot and regime in ENGINE_REGIMES, (Nb, G, Z, name, regime)
        for M in range(1, 5):
            name, _, _, regime = w4a16_launch(Nb, G, Z, None, M, "fp32", None, True, res, sm)
            assert name in digits and regime in ENGINE_REGIMES, (Nb, G, Z, M, name, regime)
        for M in W4A16_GROUP_TOKENS:             # the bf16 terms' grouped entries (bench-only) keep their rows
            assert w4a16_launch(Nb, G, Z, None, M, "fp32", None, False, res, sm, moe=True)[0] in BENCH_ONLY


def test_k26_moe_launches_are_the_same_on_the_moe_paths_row_counts():
    """What leaving the 2- and 4-row-block entries and the single-weight regime to the linear path costs K2.6:
    nothing. On the H200's 132 SMs and the RTX PRO 6000's 188, every MoE launch of K2.6's shapes (hidden 7168,
    expert width 2048, 384 experts top-8; decode and forwards of 2..64 tokens) is the one the planner chose
    over every row count, and these are the 8-row-block entries in the many-row regime (the wide bundle makes
    them on the H200: tests/test_bundles.py)."""
    for sm in (132, 188):
        now, before = moe_launches(7168, 2048, 384, 8, sm), moe_launches(7168, 2048, 384, 8, sm, moe=False)
        assert now == before, [(a, b) for a, b in zip(now, before) if a != b][:3]
        seen = {x for launch in now for x in (launch[3], f"{launch[0]}:{launch[6]}")}
        assert {"w4a16_mma_i8_m1_r8", "w4a16_mma_i8_m4_r8", "pairs:many_rows", "grouped:many_rows"} <= seen, seen


# The rule holds since the wide bundle (proofs made on the H200 at 0626ba4): every shipped entry and the MoE
# paths' regimes ran in a committed-bundle verify; the wide bundle's fast-mode proof alone ran i8_m1_r8,
# i8_m4_r8, many_rows (pairs and grouped) and ddtree_topk_kernel (docs/cuda-engine.md, "Every entry runs").


def test_every_shipped_kernel_entry_ran_in_a_proof():
    ran = set().union(*(i["kernels_ran"] for i in records()))
    missing = [n for n in SHIPPED if n not in ran]
    assert not missing, (f"{len(missing)} kernel entries the engine ships ran in no committed-bundle verify "
                         f"({', '.join(missing)}): reach them with a bundle or delete them")


def test_every_planner_regime_and_path_ran_in_a_proof():
    keys = set().union(*(i["w4a16_regimes"] for i in records()))
    regimes, paths = {k.split(":")[1] for k in keys}, {k.split(":")[0] for k in keys}
    missing = [f"regime {r}" for r in ENGINE_REGIMES if r not in regimes] + \
              [f"path {p}" for p in ENGINE_PATHS if p not in paths]
    assert not missing, (f"the fast W4A16 planner's {', '.join(missing)} ran in no committed-bundle verify "
                         f"(ran: {', '.join(sorted(keys))}): reach them with a bundle or delete them")


def test_no_proof_ran_what_the_engine_does_not_ship():
    """The other direction: no committed-bundle verify launched a bench-only entry, the linear path, or a
    regime the MoE paths leave out. (It does not prove the `moe` flag Ops.w4a16_mma passes to the planner: at
    the committed bundles' shapes the planner over every row count picks the same launches.)"""
    infos = records()
    ran = set().union(*(i["kernels_ran"] for i in infos)) & BENCH_ONLY
    keys = {k for i in infos for k in i["w4a16_regimes"]}
    odd = {k for k in keys if k.split(":")[0] not in ENGINE_PATHS or k.split(":")[1] not in ENGINE_REGIMES}
    assert not ran and not odd, (sorted(ran), sorted(odd))


def test_expert_down_takes_more_outputs_a_warp_only_where_its_grid_would_run_in_waves():
    """Ops.expert_down's choice (cuda_engine/ops.py, down_outputs_per_warp) on an H100 / H200's 132 SMs, where the
    kernel's registers (sm_90: 48 float32, 38 bf16; `kdtr kernels check`) let 5 / 6 blocks of 256 threads share an
    SM: one output a warp where the grid of one fits a wave (a tiny decode step), 4 for the tiny models' 33-row
    verify (3960 blocks of one) and K2.6's 5-row shared expert, 2 for K2.6's one-token shared expert (896 blocks)."""
    from cuda_engine.ops import EXPERT_DOWN_MAX_PER, down_outputs_per_warp

    f32, bf16 = 132 * 5, 132 * 6
    assert down_outputs_per_warp(192, 1 * 5, f32) == 1            # tiny decode: 24 x 5 blocks
    assert down_outputs_per_warp(192, 33 * 5, f32) == 4           # tiny verify: 3960 -> 990 blocks
    assert down_outputs_per_warp(7168, 1, bf16) == 2              # K2.6 one token, the shared slot: 896 -> 448
    assert down_outputs_per_warp(7168, 5, bf16) == 4              # 4480 -> 1120 blocks: the most a warp takes
    assert down_outputs_per_warp(7168, 1, 132 * 8) == 1           # where 8 blocks an SM fit, 896 is one wave
    for D in (1, 13, 192, 7168):                                   # more rows never take fewer a warp
        pers = [down_outputs_per_warp(D, rows, bf16) for rows in (1, 5, 44, 165, 2000, 10 ** 6)]
        assert pers == sorted(pers) and pers[-1] == EXPERT_DOWN_MAX_PER, (D, pers)
