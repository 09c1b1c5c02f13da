"""The launch planner of the fast W4A16 GEMM (kernels/w4a16_mma.cu): which entry, how many row blocks per
block and how many k splits one w4a16_mma launch takes, for the linear, per-pair and grouped MoE paths.

Plain functions of the launch shape and of the GPU (its SM count, an entry's resident blocks); no device call
here: cuda_engine/ops.py (Ops.w4a16_plan) asks the driver for residency and launches what this plans. The
entry tables below must say what kernels/w4a16_mma.cu instantiates (tests/test_cuda_kernels_check.py checks
them against the .cu). The measurements behind each rule are docs/cuda-engine.md's.
"""
from __future__ import annotations

W4A16_MAX_SPLITS = 64               # k splits per launch at most (the workspace and the partials' sum stay small)
# kernels/w4a16_mma.cu's entries per numerics, (most tokens per launch, entry name), and the row blocks (of 32
# rows) one block covers at that many tokens (8 warps split a row block's k range up to 8 tokens, fewer above)
W4A16_ENTRIES = {
    "fp32": ((1, "w4a16_mma_i8_m1_r1"),) + tuple((m, f"w4a16_mma_t3_m{m}") for m in (2, 5, 8, 16, 32, 64)),
    "bf16": tuple((m, f"w4a16_mma_t1_m{m}") for m in (8, 16, 32, 64)),
}
W4A16_ROW_BLOCKS = {8: 1, 16: 2, 32: 4, 64: 8}
# The FP32-faithful entries of up to 16 tokens by row blocks per block (8 / that many warps per row block), keyed
# by the entry's most tokens (1: the int8 digits; 2, 5, 8, 16: the bf16 terms): the same arithmetic, more rows
# sharing one block's staged x; w4a16_rows_plan picks one per launch shape. The bf16 terms stop at 4 row blocks
# (8 measured slower at 16 tokens on every K2.6 shape, not measured below), and at 16 tokens start at 2 (the
# entry before the row counts)
W4A16_ROWS = {1: {r: f"w4a16_mma_i8_m1_r{r}" for r in (1, 2, 4, 8)},
              **{m: {r: f"w4a16_mma_t3_m{m}" + (f"_r{r}" if r > 1 else "") for r in (1, 2, 4)} for m in (2, 5, 8)},
              16: {2: "w4a16_mma_t3_m16", 4: "w4a16_mma_t3_m16_r4"}}
W4A16_ROWS_MIN_GROUPS = 16          # a single weight's k splits keep at least this many groups (w4a16_rows_plan)
W4A16_ROWS_MAX_GROUPS = 64          # the many-row path's k splits at most this many groups (w4a16_rows_plan)
# The grouped MoE path (a forward of T > 1 tokens): a launch runs one entry for all its groups, a group of at
# most that entry's tokens (a larger one is cut into chunks). The engine's: the int8 digits of up to 4 tokens
# (W4A16_DIGITS_ROWS, each token's digits and sums exactly the per-pair path's); the bf16 terms' entries of 2,
# 5, 8 and 16 tokens take groups too (w4a16_group_tokens(T, digits=False); measured against the digits in
# tests/test_cuda_w4a16_grouped.py)
W4A16_GROUP_TOKENS = (2, 5, 8, 16)
W4A16_DIGITS_TOKENS = 4
W4A16_DIGITS_ROWS = {r: "w4a16_mma_i8_m4" + (f"_r{r}" if r > 1 else "") for r in (1, 8)}
# The row counts the MoE paths (pairs at one token, grouped over several) choose from, and their regimes: the
# single-weight regime "rows" and the 2- and 4-row-block int8 entries serve one weight (the linear path: the
# benchmark, the kernel tests) and at K2.6's MoE shapes lose to these (docs/cuda-engine.md, "Every entry
# runs"); so every entry and regime the engine ships is one a committed bundle's verify runs.
W4A16_MOE_ROWS = (1, 8)
# The planner's regimes of a w4a16_mma launch (recorded per launch in Ops.w4a16_regimes, named in a run dump's
# engine_info): w4a16_rows_plan's many-row and single-weight regimes (rows1: 1 row block unsplit at 1-2 tokens;
# rows: the most row blocks whose one-wave split keeps W4A16_ROWS_MIN_GROUPS; fewest: the family's fewest), the
# one-wave split of 17-64 tokens and of the bf16 numerics (wave), a row count a test forced (forced); and the
# path: linear (one weight, M tokens), pairs (one (token, slot) pair per z), grouped (a group of pairs per z)
W4A16_REGIMES = ("many_rows", "rows1", "rows", "fewest", "wave")
W4A16_PATHS = ("linear", "pairs", "grouped")


def w4a16_splits(blocks: int, G: int, resident: int, sm_count: int) -> int:
    """K splits of a w4a16_mma launch with `blocks` blocks per split over G groups, `resident` blocks of its
    entry fitting on the GPU at once: as many as fill one wave of at most two blocks per SM, at least one, at
    most G and W4A16_MAX_SPLITS. The split of 17..64 tokens and of the bf16 numerics; w4a16_rows_plan decides
    up to 16 FP32-faithful tokens and uses this rule for a single weight's one-wave split. Measured on the
    H200 (kdtr bench w4a16 and A/B runs, docs/cuda-engine.md): 9..64 tokens are fastest at a full wave (fewer
    splits: up to 2x slower at 64)."""
    return max(1, min(min(resident, 2 * sm_count) // max(blocks, 1), G, W4A16_MAX_SPLITS))


def w4a16_rows_plan(Nb: int, G: int, Z: int, resident: int, sm_count: int, M: int = 1,
                    rows: tuple[int, ...] = (1, 2, 4, 8)) -> tuple[int, int]:
    """(row blocks per block, k splits) of an FP32-faithful w4a16_mma launch of M <= 16 tokens with Z (token,
    slot) pairs over Nb blocks of 32 rows and G groups; `rows`: the row counts its W4A16_ROWS family has,
    `resident`: blocks of the family's first entry fitting on the GPU at once.

    A block stages x once for all its rows, so more row blocks per block share that work, but leave fewer
    blocks to fill the GPU, which k splits then make up at the cost of the split-K exchange. Never more row
    blocks per block than the weight has, rounded up to a power of two (the others' warps would idle). Two
    regimes:
    - many rows (Z * ceil(Nb / the family's most) >= the SM count: the MoE decode path and its forwards over
      many tokens): the most row blocks per block, split only so far that a split holds at most
      W4A16_ROWS_MAX_GROUPS groups (more, shorter blocks balance over the SMs) and the blocks stay within two
      waves of `resident` (beyond that a split only adds exchange and split-K workspace: Z * ks * Nb * 32
      floats);
    - a single weight: at 1 or 2 tokens, 1 row block per block where that fills the wave unsplit (their
      staging is cheap next to the weight stream); else the most row blocks per block whose one-wave split
      (w4a16_splits) keeps at least W4A16_ROWS_MIN_GROUPS groups per split, else the family's fewest at their
      one-wave split.
    Measured on the H200 (A/B runs of every row count, docs/cuda-engine.md), on the K2.6 shapes 7168 -> 2048,
    2048 -> 7168 and gate+up 7168 -> 4096: at one token (the int8 digits, also the MoE gate+up and down with 9
    slots) the fastest configuration or one within 2% of it; at 2, 4, 8 and 16 tokens (the bf16 terms) the
    fastest of 1, 2 and 4 row blocks (16 tokens: 2, 4, 8) or within 2% of it on eleven of twelve launches, the
    twelfth 7168 -> 2048 at 16 tokens (2 row blocks, 18.28 us, against 17.77 at 4). The two-wave bound and the
    many-row regime of the bf16 terms were not measured apart."""
    return w4a16_rows_regime(Nb, G, Z, resident, sm_count, M, rows)[:2]


def w4a16_rows_regime(Nb: int, G: int, Z: int, resident: int, sm_count: int, M: int = 1,
                      rows: tuple[int, ...] = (1, 2, 4, 8), single: bool = True) -> tuple[int, int, str]:
    """w4a16_rows_plan's (row blocks per block, k splits) and the regime that chose them (W4A16_REGIMES);
    single=False (the MoE paths) leaves the single-weight regime "rows" out."""
    most, fewest = max(rows), min(rows)
    top = min(most, 1 << max(0, Nb - 1).bit_length())
    if Z * -(-Nb // most) >= sm_count:
        top = max([r for r in rows if r <= top] or [fewest])
        ks = min(-(-G // W4A16_ROWS_MAX_GROUPS), 2 * resident // (Z * -(-Nb // top)))
        return top, max(1, min(ks, W4A16_MAX_SPLITS)), "many_rows"
    if M <= 2 and fewest == 1 and w4a16_splits(Nb * Z, G, resident, sm_count) == 1:
        return 1, 1, "rows1"
    for r in sorted(rows, reverse=True) if single else ():
        ks = w4a16_splits(-(-Nb // r) * Z, G, resident, sm_count)
        if fewest < r <= top and G // ks >= W4A16_ROWS_MIN_GROUPS:
            return r, ks, "rows"
    return fewest, w4a16_splits(-(-Nb // fewest) * Z, G, resident, sm_count), "fewest"


# The engine's MoE path for a forward of T tokens (docs/cuda-engine.md, "Which MoE path"): one (token, slot) pair
# per grid z up to MOE_PAIRS_MAX_TOKENS tokens (an expert read once per pair: the pairs that share it find it in
# L2 or not), the grouped path above (each touched expert read once for all its pairs). Measured on the H200 at
# K2.6's shapes (384 experts top-8): the pairs took 1.29-1.50x the distinct experts' copy floor for 2-17 tokens
# under independent routing (grouped 1.80-2.14x), and under correlated routing 1.86-2.61x up to 17 tokens (grouped
# 2.12-2.82x; equal at 17); at 33 tokens the grouped path won under correlated routing (2.38x against 2.62x). The
# two paths run each token's int8 digits alike but may split the sum over input groups differently (the planner
# plans each launch by its grid), so their bits may differ within float32 rounding: they did at 2 and 3 tokens at
# K2.6's shapes, and in the tiny bundles' 5- and 10-token prefills.
MOE_PAIRS_MAX_TOKENS = 17


def moe_path(T: int) -> str:
    """"pairs" or "grouped": the engine's fast MoE path for a forward of T tokens."""
    return "pairs" if T <= MOE_PAIRS_MAX_TOKENS else "grouped"


def w4a16_group_tokens(T: int, digits: bool = True) -> int:
    """The most tokens per group of the grouped MoE path for a forward of T >= 2 tokens: the int8 digits'
    W4A16_DIGITS_TOKENS, or (digits=False) the bf16-terms entry that holds min(T, 16) (no group exceeds T);
    a larger group is cut into chunks of that many."""
    if digits:
        return W4A16_DIGITS_TOKENS
    return next(m for m in W4A16_GROUP_TOKENS if m >= min(T, W4A16_GROUP_TOKENS[-1]))


def w4a16_groups_cap(P: int, E: int, MT: int) -> int:
    """The most groups P (token, slot) pairs over E experts make in chunks of at most MT: each group holds a
    pair, and sum over experts of ceil(c_e / MT) <= sum of (floor(c_e / MT) + 1 where c_e > 0)
    <= P // MT + min(E, P). The grouped launches' grid z."""
    return max(1, min(P, min(E, P) + P // MT))


def w4a16_entry(M: int, numerics: str = "fp32") -> tuple[str, int]:
    """(entry name, row blocks per block) of the w4a16_mma entry for M <= 64 tokens (up to 16 FP32-faithful
    tokens: the first entry of the W4A16_ROWS family w4a16_launch chooses from)."""
    m, name = next(e for e in W4A16_ENTRIES[numerics] if e[0] >= M)
    return name, next(r for mm, r in W4A16_ROW_BLOCKS.items() if mm >= m)


def w4a16_launch(Nb: int, G: int, Z: int, ks: int | None, M: int, numerics: str, rows: int | None,
                 digits: bool, resident_of, sm_count: int, moe: bool = False) -> tuple[str, int, int, str]:
    """(entry name, blocks along the output, k splits, regime) of one w4a16_mma launch of M <= 64 tokens over
    Nb blocks of 32 rows, G groups and Z (token, slot) pairs or groups: Ops.w4a16_plan's, on a GPU of
    `sm_count` SMs where `resident_of(entry)` blocks of an entry fit at once. Up to 16 FP32-faithful tokens:
    the entry and splits by w4a16_rows_regime, or `rows` row blocks per block where given (tests) at their
    one-wave split; ks, where given, overrides the splits. digits: the int8 digits entries of up to
    W4A16_DIGITS_TOKENS tokens (the grouped MoE path). moe: a launch of the MoE paths (pairs or grouped; digits
    implies it): the int8 digits entries there choose from W4A16_MOE_ROWS without the "rows" regime (the bf16
    terms' grouped entries, which only the benchmark and the kernel tests launch, keep their families). The
    regime: W4A16_REGIMES, or "forced" for rows=."""
    name, rpb = w4a16_entry(M, numerics)
    regime = "wave" if rows is None else "forced"
    # (the residency of the FP32-faithful entry, a family's first, for both numerics: the bf16 numerics run
    # w4a16_splits on their own row blocks, a different launch)
    resident = resident_of(W4A16_DIGITS_ROWS[1] if digits else w4a16_entry(M)[0])
    cap = next(m for m, _ in W4A16_ENTRIES["fp32"] if m >= M)
    _need(not digits or (numerics == "fp32" and M <= W4A16_DIGITS_TOKENS),
          f"the int8 digits entries take at most {W4A16_DIGITS_TOKENS} FP32-faithful tokens, got {M} {numerics}")
    if numerics == "fp32" and (digits or cap in W4A16_ROWS):
        family = W4A16_DIGITS_ROWS if digits else W4A16_ROWS[cap]
        if rows is None:
            moe = (moe or digits) and (digits or cap == 1)      # the int8 families (the bf16 terms: bench-only)
            choose = tuple(r for r in family if r in W4A16_MOE_ROWS) if moe else tuple(family)
            rpb, k, regime = w4a16_rows_regime(Nb, G, Z, resident, sm_count, M, choose, single=not moe)
        else:
            _need(rows in family, f"rows={rows}: choose one of {sorted(family)}")
            rpb, k = rows, w4a16_splits(-(-Nb // rows) * Z, G, resident, sm_count)
        name = family[rpb]
    else:
        _need(rows is None, f"rows={rows}: only the FP32-faithful entries of up to "
              f"{max(W4A16_ROWS)} tokens take a row count (this launch: {M} tokens, numerics {numerics})")
        k = w4a16_splits(-(-Nb // rpb) * Z, G, resident, sm_count)
    k = k if ks is None else ks
    return name, -(-Nb // rpb), max(1, min(int(k), G, W4A16_MAX_SPLITS)), regime


def _need(ok: bool, what: str) -> None:
    """A launch the kernels cannot take: the ValueError ops.py's wrappers raise, for w4a16_mma."""
    if not ok:
        raise ValueError(f"w4a16_mma: {what}")
