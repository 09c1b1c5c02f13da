"""`kdtr kernels check` on the CPU: every kernel builds for sm_120 and sm_90 without spills or sm_120
limits exceeded; and the check does fail on a spill and on too much shared memory. Needs nvcc only."""
import re
import shutil

import pytest
from click.testing import CliRunner

from cli.main import main
from cuda_engine.build import BuildError
from cuda_engine.check import KernelUsage, check_kernels, parse_ptxas
from cuda_engine.drafter import DRAFTER_SIGNATURES
from cuda_engine.ops import SIGNATURES as ENGINE_SIGNATURES

SIGNATURES = {**ENGINE_SIGNATURES, **DRAFTER_SIGNATURES}      # every kernel: the target's and the drafter's

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


@needs_nvcc
def test_kernels_check_passes_for_sm120_and_sm90():
    r = CliRunner().invoke(main, ["kernels", "check", "--arch", "sm_120", "--arch", "sm_90"])
    assert r.exit_code == 0, r.output
    for name in SIGNATURES:                                   # every kernel the engine launches, both archs
        assert name in r.output, f"{name} missing from:\n{r.output}"
    assert r.output.count("sm_90 ") == r.output.count("sm_120 ") == len(SIGNATURES)
    assert f"{2 * len(SIGNATURES)} kernel builds, 0 problem(s)" in r.output


@needs_nvcc
def test_check_fails_when_a_kernel_does_not_build(tmp_path):
    """Static shared memory is capped at 48 KB by ptxas itself: such a kernel is a build error, not a row."""
    big = tmp_path / "big.cu"
    big.write_text('extern "C" __global__ void __launch_bounds__(128) big_kernel(float* y) {\n'
                   "    __shared__ float s[26000];                // 104000 bytes\n"
                   "    s[threadIdx.x] = threadIdx.x; __syncthreads(); y[threadIdx.x] = s[127 - threadIdx.x];\n}\n")
    with pytest.raises(BuildError, match="uses too much shared data"):
        check_kernels(["sm_120"], files=[big])


def test_limits_flag_shared_memory_over_99kb():
    row = KernelUsage("sm_120", "f.cu", "k", registers=32, smem=99 * 1024 + 4, threads=256)
    assert row.problems() == ["k (f.cu, sm_120): 101380 bytes shared memory > sm_120's 101376 per block"]


def test_ptxas_report_parsing_flags_spills_and_register_pressure():
    text = """ptxas info    : Compiling entry function 'k' for 'sm_120'
ptxas info    : Function properties for k
    16 bytes stack frame, 20 bytes spill stores, 24 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 256 bytes smem
ptxas info    : Function properties for __internal_helper
    40 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"""
    (row,) = parse_ptxas(text, "sm_120", "k.cu", {"k": 512})
    assert (row.registers, row.spill_stores, row.spill_loads, row.stack, row.smem) == (255, 20, 24, 16, 256)
    assert row.problems() == ["k (k.cu, sm_120): spills (20 bytes stored, 24 bytes loaded)",
                              "k (k.cu, sm_120): 255 registers x 512 threads > 65536 per SM"]
    assert KernelUsage("sm_90", "f.cu", "ok", registers=40, threads=256).problems() == []


def test_every_kernel_entry_waits_for_the_kernel_before_it():
    """The engine's graphs let a kernel's blocks start before the kernel before it has ended (cuda_engine/graph.py);
    each entry's first statement, AFTER_PREVIOUS_GRID(), holds them. `kdtr kernels check` fails on an entry without
    it, wherever it is missing, and names the entry."""
    from cuda_engine.build import kernel_files
    from cuda_engine.check import entries_without_the_wait, source_problems

    assert source_problems() == []
    files = {f.name: f.read_text() for f in kernel_files()}
    n_entries = sum(t.count('extern "C" __global__') for t in files.values())
    assert n_entries >= 60
    cases = [("w4a16_mma.cu", "{ AFTER_PREVIOUS_GRID(); w4a16_mma_body<64, 1,", "{ w4a16_mma_body<64, 1,",
              "w4a16_mma_t1_m64"),
             ("ddtree.cu", "AFTER_PREVIOUS_GRID();\n    const int* ids", "const int* ids", "ddtree_walk_kernel"),
             ("ddtree.cu", "AFTER_PREVIOUS_GRID();\n    const int* ids",
              "const int* ids = rec + 1;\n    AFTER_PREVIOUS_GRID();", "ddtree_walk_kernel"),      # not first
             ("attention.cu", "{\n    AFTER_PREVIOUS_GRID();\n    const int S = meta[0] + T, TH",
              "{\n    // first\n    AFTER_PREVIOUS_GRID();\n    const int S = meta[0] + T, TH", "mla_softmax_kernel")]
    for file, good, bad, entry in cases:
        assert files[file].count(good) == 1, (file, good)
        found = entries_without_the_wait(files[file].replace(good, bad), file)
        assert len(found) == 1 and found[0].startswith(f"{entry} ({file})"), found
    # every kernel definition is read, however spelled (that the check reads every entry of the real sources:
    # test_the_wait_check_reads_every_entry_of_the_sources): planted kernels of other spellings that lack the wait
    # are flagged, and not one that has it, nor a comment naming one
    planted = ('// __global__ void in_a_comment() {\n'
               '__global__ void __launch_bounds__(256) not_extern(int* p) { *p = 0; }\n'
               'template <int N> __global__ void a_template(int* p) {\n  *p = N;\n}\n'
               'extern "C" {\n__global__ void in_a_block(int* p)\n{\n    *p = 1;\n}\n}\n'
               'extern "C" __global__ void waits(int* p) {\n\n    AFTER_PREVIOUS_GRID();\n    *p = 2;\n}\n')
    found = entries_without_the_wait(planted, "planted.cu")
    assert [f.split(" ")[0] for f in found] == ["not_extern", "a_template", "in_a_block"], found


def test_the_wait_check_reads_every_entry_of_the_sources():
    """Each AFTER_PREVIOUS_GRID(); of the kernel sources, deleted in turn, makes `kdtr kernels check` report
    exactly one problem, for the entry that held it: no entry of the shipped sources escapes the check (a kernel
    the check could not read would report nothing), and the check's count of entries is the kernel modules' own
    (ops.SIGNATURES and the drafter's, each entry once in the sources)."""
    from cuda_engine.build import kernel_files
    from cuda_engine.check import ENTRY_FIRST_STATEMENT, entries_without_the_wait
    from cuda_engine.drafter import DRAFTER_SIGNATURES
    from cuda_engine.ops import SIGNATURES

    names = []
    for f in kernel_files():
        text = f.read_text()
        at = [m.start() for m in re.finditer(re.escape(ENTRY_FIRST_STATEMENT), text)]
        for i in at:
            found = entries_without_the_wait(text[:i] + text[i + len(ENTRY_FIRST_STATEMENT):], f.name)
            assert len(found) == 1, (f.name, i, found)
            names.append(found[0].split(" ")[0])
    assert sorted(names) == sorted(set(SIGNATURES) | set(DRAFTER_SIGNATURES))


@pytest.mark.parametrize("comment", ["// every __global__ function here\n", "/* a __global__ { note */\n",
                                     "/* two lines:\n   __global__ kernels */\n"])
def test_a_comment_naming_global_does_not_hide_the_next_kernel(comment):
    """A comment naming __global__ with no `;` or `{` before the next kernel once ran the match on into that kernel,
    which was then skipped as if it were the comment (stop 44's review); nor may a comment's `{` end a match."""
    from cuda_engine.check import entries_without_the_wait

    planted = comment + 'extern "C" __global__ void k(int* p) {\n    *p = 1;\n}\n'
    assert [f.split(" ")[0] for f in entries_without_the_wait(planted, "planted.cu")] == ["k"]
    assert entries_without_the_wait(planted.replace("{\n", "{\n    AFTER_PREVIOUS_GRID();\n", 1), "planted.cu") == []


def test_a_brace_in_a_comment_inside_the_signature_does_not_end_it():
    """A `{` in a comment between __global__ and the body once ended the match there, so the check looked for the
    wait inside the comment and reported a kernel that has it."""
    from cuda_engine.check import entries_without_the_wait

    good = 'extern "C" __global__ void k(int* p /* { */) {\n    AFTER_PREVIOUS_GRID();\n    *p = 1;\n}\n'
    assert entries_without_the_wait(good, "planted.cu") == []
    assert [f.split(" ")[0] for f in entries_without_the_wait(good.replace("    AFTER_PREVIOUS_GRID();\n", ""),
                                                               "planted.cu")] == ["k"]


def test_w4a16_wrapper_tables_match_the_kernel_entries():
    """w4a16_plan.py picks a w4a16_mma entry by numerics and token count and ops.py sizes its grid by the entry's row blocks
    per block: both tables must say what kernels/w4a16_mma.cu instantiates (a mismatch would launch too few
    blocks, or the wrong numerics)."""
    import re

    from cuda_engine.build import KERNEL_DIR
    from cuda_engine.w4a16_plan import W4A16_DIGITS_ROWS, W4A16_DIGITS_TOKENS, W4A16_ENTRIES, W4A16_ROW_BLOCKS, W4A16_ROWS

    text = (KERNEL_DIR / "w4a16_mma.cu").read_text()
    entry = (r"(w4a16_mma_(i8|t\d)_m(\d+)(?:_r(\d+))?)\(W4A16_ARGS\) \{ AFTER_PREVIOUS_GRID\(\); "
             r"w4a16_mma_body<(\d+), (\d), (?:true|false), (\d), \d, (true|false)>")
    entries = re.findall(entry, text)           # (name, kind, most tokens, R, MT, TERMS, WS, I8) per entry
    assert len(entries) == len(set(e[0] for e in entries)) > 0
    table = {name: (m, numerics) for numerics, es in W4A16_ENTRIES.items() for m, name in es}
    table.update({name: (m, "fp32") for m, family in W4A16_ROWS.items() for name in family.values()})
    table.update({name: (W4A16_DIGITS_TOKENS, "fp32") for name in W4A16_DIGITS_ROWS.values()})  # grouped MoE
    assert {e[0] for e in entries} == set(table)
    rows = {name: r for family in (*W4A16_ROWS.values(), W4A16_DIGITS_ROWS) for r, name in family.items()}
    for name, kind, m, r, mt, terms, ws, i8 in entries:
        top, numerics = table[name]
        rpb = int(r) if r else next(rb for t, rb in W4A16_ROW_BLOCKS.items() if t >= int(m))
        assert rows.get(name, rpb) == rpb, name                               # W4A16_ROWS names its row count
        assert (int(mt), int(m), 8 // int(ws)) == (top, top, rpb), name
        assert (i8 == "true") == (kind == "i8"), name                           # the int8 digits path
        assert numerics == ("bf16" if int(terms) == 1 and i8 == "false" else "fp32"), name
    sizes = {numerics: [m for m, _ in es] for numerics, es in W4A16_ENTRIES.items()}
    assert all(s == sorted(s) and s[-1] == 64 for s in sizes.values())        # every M <= 64 has an entry


def test_w4a16_splits_follow_the_measured_costs():
    """w4a16_splits on the H200 (132 SMs): one K2.6 weight at batch 1 (64 blocks of rows, 224 groups; the int8
    entry fits 3 blocks per SM) takes 4 splits (the fastest measured); the MoE path's gate+up (1152 blocks) and
    down (2016 blocks) stay unsplit; 64 tokens (8 blocks, 1 per SM) fill the wave with 16 splits and 16 tokens
    (32 blocks, 2 per SM) with 8; never more splits than groups or W4A16_MAX_SPLITS."""
    from cuda_engine.w4a16_plan import W4A16_MAX_SPLITS, w4a16_splits

    assert w4a16_splits(64, 224, 396, 132) == 4
    assert w4a16_splits(1152, 224, 396, 132) == 1
    assert w4a16_splits(2016, 64, 396, 132) == 1
    assert w4a16_splits(8, 224, 132, 132) == 16
    assert w4a16_splits(32, 224, 264, 132) == 8
    assert w4a16_splits(1, 3, 264, 132) == 3
    assert w4a16_splits(1, 224, 264, 132) == W4A16_MAX_SPLITS
    assert all(1 <= w4a16_splits(b, G, 396, 132) <= min(G, W4A16_MAX_SPLITS) for b in (1, 7, 64, 500) for G in (1, 5, 224))


def test_w4a16_rows_plan_picks_the_measured_configurations():
    """w4a16_rows_plan on the H200 (132 SMs; 396 resident blocks of the int8 entries, 264 of the bf16 terms'),
    the (row blocks per block, k splits) the A/B runs of docs/cuda-engine.md measured fastest or within 2% of
    it. One token: the MoE decode launches (9 slots) take 8 row blocks per block, gate+up (224 groups) in 4
    splits of 56 groups, down (64 groups) unsplit; a single K2.6 weight whose 32-row blocks fill the wave
    unsplit (2048 -> 7168) 1 row block, the others the most row blocks that keep 16 groups a split; small
    shapes (engine bundles) fall back to the family's fewest row blocks at the one-wave split. 2..16 tokens
    (the bf16 terms, at most 4 row blocks): the same on the single K2.6 weights, except that from 3 tokens
    2048 -> 7168 shares its staging over 4 row blocks too (measured at 4, 8, 16)."""
    from cuda_engine.w4a16_plan import W4A16_MAX_SPLITS, W4A16_ROWS, w4a16_rows_plan, w4a16_splits

    plan = lambda Nb, G, Z, M=1, resident=396: w4a16_rows_plan(Nb, G, Z, resident, 132, M,  # noqa: E731
                                                                tuple(W4A16_ROWS[next(m for m in W4A16_ROWS if m >= M)]))
    assert plan(128, 224, 9) == (8, 4)                          # MoE gate+up: 52.78 us (the fastest)
    assert plan(224, 64, 9) == (8, 1)                           # MoE down: 26.5 us (the fastest)
    assert plan(64, 224, 1) == (2, 8)                           # 7168 -> 2048: 8.45 us (fastest 8.29)
    assert plan(224, 64, 1) == (1, 1)                           # 2048 -> 7168: 7.84 us (fastest 7.82)
    assert plan(128, 224, 1) == (4, 8)                          # gate+up 7168 -> 4096: 11.54 us (fastest 11.42)
    assert plan(2, 3, 8) == (1, w4a16_splits(16, 3, 396, 132))
    # the bf16 terms at 2 | 4 | 8 | 16 tokens, microseconds of the plan's choice (the fastest where not named)
    assert [plan(64, 224, 1, M, 264) for M in (2, 4, 8, 16)] == [(2, 8)] * 4     # 8.34 | 9.89 | 13.31 | 18.28 (17.77)
    assert [plan(224, 64, 1, M, 264) for M in (2, 4, 8, 16)] == [(1, 1)] + [(4, 4)] * 3   # 7.92 | 10.34 (10.17) | 13.18 | 17.60
    assert [plan(128, 224, 1, M, 264) for M in (2, 4, 8, 16)] == [(4, 8)] * 4    # 12.12 | 14.31 | 18.78 | 26.32
    assert plan(2, 3, 8, 16, 264) == (2, w4a16_splits(8, 3, 264, 132))          # 16 tokens: 2 row blocks at least
    # many (token, slot) pairs (a forward over many tokens): no split past two waves, so no split-K workspace
    # for a long prompt (it would be Z * ks * Nb * 32 floats, never freed); 16 pairs: 256 blocks, 3 splits
    assert plan(128, 224, 9 * 64) == (8, 1)
    assert plan(128, 224, 16) == (8, 3)
    assert plan(1152, 224, 1, 8, 264) == (4, 1)                 # the bf16 terms: 4 row blocks at most
    # the many-row regime counts blocks at the family's most row blocks (4 for the bf16 terms: 600 row blocks
    # are 150 blocks, over the 132 SMs; at 8 they would be 75 and take the single-weight path), and at 16
    # tokens never goes below the family's fewest (2), even for a one-row-block weight
    assert plan(600, 224, 1, 8, 264) == (4, 3)
    assert plan(1, 224, 200, 16, 264)[0] == 2
    # never more row blocks per block than the weight has (rounded up to a power of two): idle warps otherwise
    assert plan(2, 6, 132) == (2, 1)                            # the tiny bundle's gate+up in a verify forward
    assert plan(4, 2048, 1) == (4, 64)
    for M in W4A16_ROWS:
        for Nb in (1, 3, 64, 500, 1200):
            for G in (1, 5, 224):
                for Z in (1, 9):
                    r, ks = plan(Nb, G, Z, M)
                    assert r in W4A16_ROWS[M] and 1 <= ks <= min(G, W4A16_MAX_SPLITS), (M, Nb, G, Z)


def test_combine_slice_matches_the_kernel():
    """ops.py launches ceil(D / COMBINE_DSLICE) combine blocks per token and sizes the norm's partials by it;
    a block of kernels/moe.cu covers COMBINE_DSLICE elements (one per thread): a mismatch would leave
    elements of every row uncomputed."""
    import re

    from cuda_engine.build import KERNEL_DIR
    from cuda_engine.ops import BLOCK, COMBINE_DSLICE, WARPS_PER_BLOCK

    common = (KERNEL_DIR / "common.cuh").read_text()
    assert re.search(r"#define WARPS_PER_BLOCK (\d+)", common)[1] == str(WARPS_PER_BLOCK)
    assert re.search(r"#define COMBINE_DSLICE (\w+)", (KERNEL_DIR / "moe.cu").read_text())[1] == "BLOCK_THREADS"
    assert COMBINE_DSLICE == BLOCK[0] == 32 * WARPS_PER_BLOCK


def test_linear_rows_match_the_kernel():
    """ops.py launches ceil(T / LINEAR_ROWS) row blocks of linear_rows_kernel; a block of kernels/linear.cu
    computes LINEAR_ROWS rows: a smaller kernel value would leave rows uncomputed, a larger one write past y."""
    import re

    from cuda_engine.build import KERNEL_DIR
    from cuda_engine.ops import LINEAR_ROWS

    assert re.search(r"#define LINEAR_ROWS (\d+)", (KERNEL_DIR / "linear.cu").read_text())[1] == str(LINEAR_ROWS)


def test_linear_mma_tile_matches_the_kernel():
    """ops.py launches ceil(O / LMMA_OUT) x ceil(T / LMMA_ROWS) blocks of linear_mma_bf16_kernel (LMMA_FEW_OUT x
    LMMA_FEW_ROWS of linear_mma_bf16_few_kernel, for 2 .. LMMA_FEW_ROWS rows); a block of kernels/linear.cu
    computes that many outputs and rows: another kernel value would leave outputs unwritten or write past y."""
    import re

    from cuda_engine.build import KERNEL_DIR
    from cuda_engine.ops import LMMA_FEW_OUT, LMMA_FEW_ROWS, LMMA_OUT, LMMA_ROWS

    src = (KERNEL_DIR / "linear.cu").read_text()
    for name, value in (("LMMA_OUT", LMMA_OUT), ("LMMA_ROWS", LMMA_ROWS), ("LMMA_FEW_OUT", LMMA_FEW_OUT),
                        ("LMMA_FEW_ROWS", LMMA_FEW_ROWS)):
        assert re.search(rf"#define {name} (\d+)", src)[1] == str(value), name


def test_grouped_moe_groups_cap_holds_for_every_routing():
    """The grouped MoE path launches w4a16_groups_cap(P, E, MT) z's and moe_group_kernel writes at most that
    many groups: every count of P pairs over E experts cut into chunks of MT needs no more (random routings,
    and the extremes: one expert takes every pair, every pair its own expert, every expert MT + 1 pairs); and
    the cap is reached (a bound, not a guess). The chunk sizes: the int8 digits' 4 tokens, the bf16 terms'
    entry for min(T, 16)."""
    import numpy as np

    from cuda_engine.w4a16_plan import W4A16_DIGITS_TOKENS, w4a16_group_tokens, w4a16_groups_cap

    def groups(counts, MT):
        return sum(-(-c // MT) for c in counts if c)

    rng = np.random.default_rng(0)
    reached = False
    for _ in range(300):
        E, MT = int(rng.integers(1, 400)), int(rng.choice([2, 4, 5, 8, 16]))
        P = int(rng.integers(1, 600))
        counts = np.bincount(rng.integers(0, E, P), minlength=E)
        assert groups(counts, MT) <= w4a16_groups_cap(P, E, MT), (P, E, MT)
    for P, E, MT in ((64, 8, 16), (33, 1, 16), (128, 384, 4), (40, 41, 4)):
        for counts in ([P] + [0] * (E - 1), [1] * P + [0] * max(0, E - P),
                       [MT + 1] * (P // (MT + 1)) + [P % (MT + 1)]):
            if len(counts) <= E or sum(counts) == P:
                assert groups(counts, MT) <= w4a16_groups_cap(P, max(E, len(counts)), MT)
                reached |= groups(counts, MT) == w4a16_groups_cap(P, max(E, len(counts)), MT)
    assert reached
    terms = [w4a16_group_tokens(T, digits=False) for T in (2, 3, 5, 6, 8, 9, 16, 17, 100)]
    assert terms == [2, 5, 5, 8, 8, 16, 16, 16, 16]
    assert w4a16_group_tokens(33) == W4A16_DIGITS_TOKENS == 4


def test_w4a16_launch_plans_without_a_device_and_refuses_what_no_entry_takes():
    """w4a16_launch is the planner Ops.w4a16_plan runs on the GPU's SM count and residency; with them given
    (the H200's, as above) it plans on the CPU: the entry its rows plan names, its blocks and splits, and the
    regime; a row count its family lacks, rows= outside the FP32-faithful entries and the int8 digits past
    W4A16_DIGITS_TOKENS are refused, naming the launch."""
    from cuda_engine.w4a16_plan import W4A16_DIGITS_ROWS, W4A16_ROWS, w4a16_launch

    h200 = dict(resident_of=lambda entry: 396, sm_count=132)
    assert w4a16_launch(128, 224, 9, None, 1, "fp32", None, False, **h200) == (W4A16_ROWS[1][8], 16, 4, "many_rows")
    assert w4a16_launch(224, 64, 1, None, 1, "fp32", None, False, **h200) == (W4A16_ROWS[1][1], 224, 1, "rows1")
    assert w4a16_launch(64, 224, 1, 3, 1, "fp32", 4, False, **h200) == (W4A16_ROWS[1][4], 16, 3, "forced")
    assert w4a16_launch(64, 224, 1, None, 64, "bf16", None, False, **h200)[::3] == ("w4a16_mma_t1_m64", "wave")
    assert w4a16_launch(128, 224, 40, None, 4, "fp32", None, True, **h200)[0] in W4A16_DIGITS_ROWS.values()
    with pytest.raises(ValueError, match=r"w4a16_mma: rows=3: choose one of \[1, 2, 4, 8\]"):
        w4a16_launch(64, 224, 1, None, 1, "fp32", 3, False, **h200)
    with pytest.raises(ValueError, match="w4a16_mma: rows=2: only the FP32-faithful entries of up to 16 tokens"):
        w4a16_launch(64, 224, 1, None, 32, "fp32", 2, False, **h200)
    with pytest.raises(ValueError, match="w4a16_mma: the int8 digits entries take at most 4 FP32-faithful tokens"):
        w4a16_launch(64, 224, 1, None, 5, "fp32", None, True, **h200)


def test_kernels_check_exits_with_the_named_codes(monkeypatch):
    """A kernel over a limit or one that does not compile is the engine's fault (6); no nvcc means the check
    cannot run here (2): the codes every other command gives these meanings (conformance/exit_codes.py)."""
    import cli.kernels_cmd
    from conformance.exit_codes import ExitCode
    from cuda_engine.build import NvccNotFound

    def run(result):
        def fake(archs):
            if isinstance(result, Exception):
                raise result
            return result
        monkeypatch.setattr(cli.kernels_cmd, "check_kernels", fake)
        return CliRunner().invoke(main, ["kernels", "check", "--arch", "sm_120"])

    row = KernelUsage("sm_120", "f.cu", "k", registers=32, smem=99 * 1024 + 4, threads=256)
    assert run(([row], row.problems())).exit_code == ExitCode.ENGINE_ERROR
    assert run(BuildError("nvcc failed (exit 1)")).exit_code == ExitCode.ENGINE_ERROR
    r = run(NvccNotFound("nvcc not found on PATH"))
    assert r.exit_code == ExitCode.USAGE and "kdtr kernels check: nvcc not found on PATH" in r.output
    assert run(([KernelUsage("sm_120", "f.cu", "k", registers=32, threads=256)], [])).exit_code == ExitCode.OK


def test_the_hosts_launch_constants_are_the_kernels():
    """ops.py launches the attention GEMMs with dynamic shared memory and sizes p c_kv's chunks by their blocks
    per SM; both are written in kernels/attention.cu too, per tiling (Narrow, Wide). A host figure smaller than
    the kernel's would let the kernel run past its shared memory; blocks per SM that differ would leave a wave
    part empty or add a second one; a tile the host counts otherwise would leave rows or columns out."""
    import re

    from cuda_engine.build import KERNEL_DIR
    from cuda_engine.ops import ATTN_DYNAMIC_SMEM, ATTN_KSTEP, ATTN_NARROW, ATTN_SPITCH, ATTN_STAGES, ATTN_WIDE

    src = (KERNEL_DIR / "attention.cu").read_text()
    d = {k: int(v) for k, v in re.findall(r"#define (KSTEP|GEMM_STAGES) (\d+)\b", src)}
    assert (d["KSTEP"], d["GEMM_STAGES"]) == (ATTN_KSTEP, ATTN_STAGES)
    assert re.search(r"#define SPITCH \(KSTEP \+ 8\)", src) and ATTN_SPITCH == ATTN_KSTEP + 8
    assert re.search(r"static constexpr int VPITCH = COLS \+ 8;", src)
    assert re.search(r"#define SCORES_SMEM\(TL\) \(GEMM_STAGES \* 3 \* \(TL::ROWS \+ TL::COLS\) \* SPITCH \* 2\)", src)
    assert re.search(r"#define PV_SMEM\(TL\) \(GEMM_STAGES \* 3 \* \(TL::ROWS \* SPITCH \+ KSTEP \* TL::VPITCH\) \* 2\)",
                     src)
    assert re.search(r"ROWS = WARPS_M \* 16 \* WM, COLS = WARPS_PER_BLOCK / WARPS_M \* 8 \* WN;", src)
    # the layouts the bodies use are the ones the macros count: GEMM_STAGES x (A_ELEMS + B_ELEMS) bf16
    bodies = re.findall(r"constexpr int A_ELEMS = ([^,]+), B_ELEMS = ([^;]+);", src)
    assert bodies == [("3 * TL::ROWS * SPITCH", "3 * TL::COLS * SPITCH"),           # mla_scores_body
                      ("3 * TL::ROWS * SPITCH", "3 * KSTEP * TL::VPITCH")], bodies   # mla_pv_body
    assert len(re.findall(r"bf16_t\* Bs = As \+ GEMM_STAGES \* A_ELEMS;", src)) == 2
    tilings = {name: (int(wm_) * 16 * int(wm), 8 // int(wm_) * 8 * int(wn))
               for wm_, wm, wn, name in re.findall(r"typedef Tiling<(\d+), (\d+), (\d+)> (\w+);", src)}
    # `#if __CUDA_ARCH__ >= 1000` (sm_120) first, then sm_90's
    bps = {name: dict(zip((12, 9), (int(v) for v in re.findall(rf"#define {name.upper()}_BLOCKS_PER_SM (\d+)\b", src))))
           for name in tilings}
    host = {"Narrow": ATTN_NARROW, "Wide": ATTN_WIDE}
    assert set(tilings) == set(host)
    for name, tl in host.items():
        assert (tl.rows, tl.cols) == tilings[name] and tl.blocks_per_sm == bps[name], name
    kernels = re.findall(r"__launch_bounds__\(BLOCK_THREADS, (\w+)_BLOCKS_PER_SM\) (mla_(?:scores|pv)\w*_kernel)\("
                         r"[^{]*\{[^}]*?mla_\w+_body<(\w+)>", src)
    assert sorted(k for _, k, _ in kernels) == sorted(ATTN_DYNAMIC_SMEM)
    for bound, kernel, tiling in kernels:
        tl = host[tiling]
        assert bound == tiling.upper() and kernel.endswith(f"{tl.suffix}_kernel"), kernel
        assert ATTN_DYNAMIC_SMEM[kernel] == (tl.scores_smem() if "_scores" in kernel else tl.pv_smem()), kernel

