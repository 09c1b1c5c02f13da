"""The CUDA engine's own DDTree (cuda_engine/ddtree.py, cuda_engine/drafter.py).

GPU: the drafter's per-depth logits against refmodel's drafter in float64 (tolerance from the float32
NumPy run of the same loop); the device tree mask equals compile_tree's; every verified node's logits
equal a float64 AR replay of its ancestor path within the bundle's derived AR-logits tolerance, and equal
the engine's own causal forward over that path; two runs (and a run without CUDA graphs) give identical
records; `kdtr verify --engine cuda` passes its live DDTree checks on both bundles.
CPU: the verify's packed inputs are compile_tree's; the drafter weights read from a bundle are exact.
"""
import importlib.util

import numpy as np
import pytest

from cuda_oracle import check, committed_bundles, gpu_ops
from kdtr_format import open_kdtr
from refmodel.ddtree import build_ddtree, compile_tree

BUNDLES = committed_bundles()
TINY = "bundles/model_tiny.kdtr"
N_TOKENS = 24


def _prompts(f):
    from conformance.records import position_offset, prompts_of

    return [(np.asarray(f[f"golden/p{i}/prompt_ids"]), position_offset(f, i)) for i in prompts_of(f)]


def _random_tree(seed: int, L: int = 15, V: int = 400, budget: int = 32):
    rng = np.random.default_rng(seed)
    return build_ddtree(rng.normal(0, 3, (L, V)).astype(np.float32), budget)


# ------------------------------------------------------------------------------------------------ CPU


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_verify_inputs_are_compile_tree(seed):
    from cuda_engine.ddtree_io import pack_tree_inputs

    tree = _random_tree(seed)
    ids, positions, _ = compile_tree(tree, 7, 11, 1000)
    ti = pack_tree_inputs(tree, 7, 11, 1000)
    T = tree.size
    assert ti.dtype == np.int32 and ti.shape == (4 + 3 * T,) and ti[0] == 11
    assert np.array_equal(ti[4:4 + T], ids) and np.array_equal(ti[4 + T:4 + 2 * T], positions)
    assert np.array_equal(ti[4 + 2 * T:], tree.parents)


def test_tree_rows_is_what_build_ddtree_makes():
    from cuda_engine.ddtree import tree_rows

    x = np.random.default_rng(3).normal(0, 2, (15, 400)).astype(np.float32)
    for budget, topk, L in ((32, None, 15), (15, 1, 15), (40, 1, 15), (5, None, 1), (0, None, 15), (300, 2, 7),
                            (7, 3, 1)):
        K = min(budget if topk is None else topk, 400) if budget > 0 else 0
        assert tree_rows(budget, L, K) == build_ddtree(x[:L], budget, topk).size, (budget, topk, L)


def test_unpack_tree_reads_the_device_layout():
    from cuda_engine.ddtree_io import unpack_tree

    tree = _random_tree(4)
    T = tree.size
    post = np.arange(T) % 7
    rec = np.concatenate([[T - 1], [9], tree.tokens, tree.parents, [0], tree.depths, [0], tree.ranks, post])
    got, got_post = unpack_tree(rec.astype(np.int32), T)
    for k in ("tokens", "depths", "parents", "ranks"):
        assert np.array_equal(getattr(got, k), getattr(tree, k)), k
    assert got.child_maps == tree.child_maps and np.array_equal(got_post, post)


def test_unpack_tree_refuses_a_tree_of_another_size():
    from cuda_engine.ddtree_io import unpack_tree
    from cuda_engine.device import CudaEngineError

    with pytest.raises(CudaEngineError, match="made 3 nodes where the verify was sized for 32"):
        unpack_tree(np.array([3] + [0] * 5 * 33, np.int32), 33)


def test_the_bench_reads_the_golden_prompts_as_the_runner():
    from conformance.records import position_offset, prompts_of
    from cuda_engine.bench_ddtree import _golden_prompts

    with open_kdtr(TINY) as f:
        got = _golden_prompts(f)
        want = [(np.asarray(f[f"golden/p{i}/prompt_ids"]), position_offset(f, i)) for i in prompts_of(f)]
    assert len(got) == len(want) >= 2 and any(pos0 > 0 for _, pos0 in got)
    assert all(np.array_equal(a, b) and p == q for (a, p), (b, q) in zip(got, want))


def test_the_engines_records_are_the_reference_engines():
    """One builder of the `ddtree_live/` records (refmodel.ddtree.live_records): the CUDA engine (which never
    imports conformance) and the reference engine both use it, and on a real refmodel run its records are
    the Rounds' own, in the layout of docs/run-dump.md §2."""
    import cuda_engine.ddtree
    from conformance import records
    from conformance.engines import reference_engine
    from refmodel.drafter import read_drafter
    from refmodel.stored import read_model
    from refmodel import ddtree

    assert cuda_engine.ddtree.live_records is ddtree.live_records, "the CUDA engine builds its own records"
    assert records.live_records is ddtree.live_records and reference_engine.live_records is ddtree.live_records
    with open_kdtr(TINY) as f:
        cfg, W = read_model(f)
        dcfg, DW = read_drafter(f)
        settings = f.metadata["ddtree"]
        prompt = np.asarray(f["golden/p0/prompt_ids"])
    g = ddtree.ddtree_generate(cfg, W, dcfg, DW, prompt, 12, budget=settings["budget"])
    rec, R = cuda_engine.ddtree.live_records(g.tokens, g.rounds, g.counters.target_forwards), g.rounds
    assert R and list(rec["counters"]) == [1 + len(R), len(R)] == [g.counters.target_forwards, len(R)]
    assert list(rec["tokens"]) == list(g.tokens) and list(rec["round_bonus"]) == [r.bonus for r in R]
    sizes = [r.tree_size for r in R]
    assert len(rec["tree_tokens"]) == len(rec["tree_parents"]) == len(rec["verify_argmax"]) == sum(sizes)
    roots = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    assert np.all(rec["tree_tokens"][roots] == -1) and np.all(rec["tree_parents"][roots] == -1)
    acc = rec["accepted_offsets"]
    assert list(np.diff(acc)) == [len(r.accepted) for r in R] and rec["path_logits"].shape[0] == acc[-1]
    for r, lo in zip(R, acc[:-1]):
        assert list(rec["accepted"][lo:lo + len(r.accepted)]) == list(r.accepted)
        assert np.array_equal(rec["path_logits"][lo:lo + len(r.accepted)], r.path_logits)
    assert all(v.dtype == np.int64 for k, v in rec.items() if k != "path_logits")


def test_read_drafter_is_the_bundles_drafter_exactly():
    from cuda_engine.drafter import read_drafter
    from refmodel import drafter as refmodel_drafter

    dcfg, DW, settings = read_drafter(TINY)
    with open_kdtr(TINY) as f:
        rcfg, RW = refmodel_drafter.read_drafter(f)
        rsettings = f.metadata["ddtree"]
    assert dcfg == rcfg and settings == rsettings and DW.keys() == RW.keys()
    for k in DW:
        assert DW[k].dtype == np.float32 and np.array_equal(DW[k].astype(np.float64), RW[k]), k


def test_read_drafter_without_a_drafter_is_none():
    from cuda_engine.drafter import read_drafter

    class NoDrafter:
        metadata, names = {}, []

    assert read_drafter(NoDrafter()) is None


# ------------------------------------------------------------------------------------------------ GPU


@pytest.fixture(scope="module")
def engine_cls():
    gpu_ops()                                                    # skips without pycuda / a device
    from cuda_engine.engine import CudaEngine

    return CudaEngine


@pytest.fixture(scope="module")
def tiny_run(engine_cls):
    """The GPU loop on every golden prompt of the tiny bundle, with each round's logits kept."""
    from cuda_engine.ddtree import ddtree_run

    e = engine_cls()
    e.load(TINY)
    with open_kdtr(TINY) as f:
        prompts = _prompts(f)
    return e, prompts, [ddtree_run(e, p, pos0, N_TOKENS, keep_logits=True) for p, pos0 in prompts]


def _reference_drafts(prompt, pos0, n, dtype):
    """{start: drafter logits [L, V]} of refmodel's DDTree loop in `dtype` on the tiny bundle."""
    from refmodel.drafter import read_drafter
    from refmodel.stored import read_model
    from refmodel.ddtree import draft_logits, prefill, verify_round

    with open_kdtr(TINY) as f:
        cfg, W = read_model(f)
        dcfg, DW = read_drafter(f)
        settings = f.metadata["ddtree"]
    W = {k: v.astype(dtype) for k, v in W.items()}
    DW = {k: v.astype(dtype) for k, v in DW.items()}
    dec, drafts = prefill(cfg, W, np.asarray(prompt, np.int64), dcfg, pos0), {}
    while len(dec.out) - len(prompt) < n:
        q = draft_logits(W, dcfg, DW, dec)
        drafts[dec.start] = q
        verify_round(cfg, W, dcfg, dec, build_ddtree(q, settings["budget"], settings.get("topk")))
    return drafts


@pytest.mark.cuda
def test_drafter_logits_match_refmodel(tiny_run):
    """At every round start the GPU loop shares with refmodel's loop (in exact arithmetic the drafter's
    input there is the same), the GPU drafter's logits are within FACTOR x the float32 NumPy error."""
    _, prompts, runs = tiny_run
    compared = 0
    for (prompt, pos0), (_, stats) in zip(prompts, runs):
        gold, base = (_reference_drafts(prompt, pos0, N_TOKENS, dt) for dt in (np.float64, np.float32))
        for r in stats["verify"]:
            if r["start"] in gold and r["start"] in base:
                check(f"drafter logits, pos0 {pos0}, start {r['start']}", r["draft_logits"], gold[r["start"]],
                      base[r["start"]])
                compared += 1
    assert compared >= len(prompts)


@pytest.mark.cuda
def test_device_tree_mask_is_compile_trees(engine_cls):
    from cuda_engine.ddtree_io import pack_tree_inputs
    from cuda_engine.device import DevBuf
    from cuda_engine.drafter import tree_mask

    e = engine_cls()
    e.load(TINY)
    for seed, start in ((0, 5), (1, 40), (2, 0)):
        tree = _random_tree(seed)
        T = tree.size
        _, _, want = compile_tree(tree, 1, start)
        ti = DevBuf.from_array(pack_tree_inputs(tree, 1, start, 0))
        mask = DevBuf((T, start + T + 3), np.float32)
        tree_mask(e.ops, DevBuf((T,), np.int32, ti.ptr + (4 + 2 * T) * 4, ti), T, ti, mask)
        e.ops.stream.synchronize()
        assert np.array_equal(mask.get()[:, :start + T], want.astype(np.float32)), (seed, start)


def _device_build(e, x, budget, start=5, pos0=100, root=3, given=None):
    """Run the device builder on logits x [L, V] (or, with given=(top_id, lp), the heap alone on them)."""
    from cuda_engine.ddtree import tree_rows
    from cuda_engine.ddtree_io import unpack_tree
    from cuda_engine.device import DevBuf
    from cuda_engine.drafter import build_tree

    L, V = x.shape
    K = min(budget, V)
    T = tree_rows(budget, L, K)
    top_id, lp = DevBuf((L, K), np.int32), DevBuf((L, K), np.float32)
    if given is not None:
        top_id.set(given[0].astype(np.int32))
        lp.set(given[1])
    dmeta = DevBuf.from_array(np.array([0, 0, start, pos0 + start], np.int32))
    ids = DevBuf.from_array(np.array([root], np.int32))
    rec, t_meta, t_ids, t_pos = (DevBuf((n,), np.int32) for n in (1 + 5 * T, 4, T, T))
    build_tree(e.ops, DevBuf.from_array(x), V, L, K, budget, T, top_id, lp, dmeta, ids, rec, t_meta, t_ids, t_pos,
               topk=given is None)
    e.ops.stream.synchronize()
    tree, _ = unpack_tree(rec.get(), T)
    return tree, top_id.get(), lp.get(), t_meta.get(), t_ids.get(), t_pos.get()


def _log_probs64(x, top_id) -> np.ndarray:
    """The float64 log-softmax of logits x [L, V] at the ids top_id [L, K]: the oracle of the builder's log-probs."""
    x = np.asarray(x, np.float64)                                                   # [L, V]
    m = x.max(axis=-1, keepdims=True)                                               # [L, 1]
    log_z = m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True))                   # [L, 1]
    return np.take_along_axis(x, np.asarray(top_id, np.int64), axis=-1) - log_z     # [L, K]


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["normal", "ties"])
def test_device_builder_is_build_ddtree(engine_cls, case):
    """Top-K ids exactly (ties to the lower id), log-probs against the float64 log-softmax within check's
    derived tolerance (FACTOR x the float32 NumPy log-softmax's error, refmodel's own _top_log_probs), the tree
    exactly, and the verify inputs compile_tree's. "ties": one row of small integers repeated at every
    depth, so equal scores across depths exercise the rank-path tie rule."""
    from refmodel.ddtree import _top_log_probs

    e = engine_cls()
    e.load(TINY)
    rng = np.random.default_rng(7)
    for seed in range(4):
        if case == "normal":
            x = rng.normal(0, 3, (15, 400)).astype(np.float32)
        else:
            x = np.tile(rng.integers(0, 4, 400).astype(np.float32), (15, 1))
        for budget in (32, 7, 64):
            want = build_ddtree(x, budget)
            tree, top_id, lp, t_meta, t_ids, t_pos = _device_build(e, x, budget)
            ref_id, ref_lp = _top_log_probs(x, min(budget, 400))          # float32 NumPy: the baseline
            assert np.array_equal(top_id, ref_id), (seed, budget)
            check(f"{case} seed {seed} budget {budget}: device log-probs", lp, _log_probs64(x, ref_id), ref_lp)
            for k in ("tokens", "depths", "parents", "ranks"):
                assert np.array_equal(getattr(tree, k), getattr(want, k)), (case, seed, budget, k)
            ids, positions, _ = compile_tree(want, 3, 5, 100)
            assert t_meta[0] == 5 and np.array_equal(t_ids, ids) and np.array_equal(t_pos, positions)


@pytest.mark.cuda
def test_selection_top_k_for_large_vocabularies_is_the_sorts(engine_cls):
    """ddtree_topk_kernel (vocabularies past the bitonic sort's limit) gives the same ids and log-probs."""
    from cuda_engine.device import DevBuf
    from cuda_engine.drafter import prepare_kernels
    from refmodel.ddtree import _top_log_probs

    e = engine_cls()
    e.load(TINY)
    prepare_kernels(e.ops)
    rng = np.random.default_rng(5)
    for x in (rng.normal(0, 3, (15, 400)), np.tile(rng.integers(0, 4, 400), (15, 1))):
        x = x.astype(np.float32)
        top_id, lp = DevBuf((15, 32), np.int32), DevBuf((15, 32), np.float32)
        e.ops._launch("ddtree_topk_kernel", (15,), DevBuf.from_array(x).ptr, 400, 32, top_id.ptr, lp.ptr)
        e.ops.stream.synchronize()
        ref_id, ref_lp = _top_log_probs(x, 32)
        _, sort_id, sort_lp, *_ = _device_build(e, x, 32)
        assert np.array_equal(top_id.get(), ref_id) and np.array_equal(top_id.get(), sort_id)
        assert np.array_equal(lp.get(), sort_lp)


@pytest.mark.cuda
def test_device_heap_on_numpys_log_probs_is_build_ddtree_exactly(engine_cls):
    """The heap alone, fed NumPy's own top-K and log-probs: the same tree bit for bit, ties included."""
    from refmodel.ddtree import _top_log_probs

    e = engine_cls()
    e.load(TINY)
    rng = np.random.default_rng(11)
    for seed in range(6):
        x = (rng.normal(0, 3, (15, 400)) if seed % 2 else np.tile(rng.integers(0, 3, 400), (15, 1))).astype(np.float32)
        want = build_ddtree(x, 32)
        tree = _device_build(e, x, 32, given=_top_log_probs(x, 32))[0]
        for k in ("tokens", "depths", "parents", "ranks"):
            assert np.array_equal(getattr(tree, k), getattr(want, k)), (seed, k)


@pytest.mark.cuda
def test_device_and_host_builders_give_the_same_run(tiny_run):
    from cuda_engine.ddtree import ddtree_run

    e, prompts, runs = tiny_run
    for (prompt, pos0), (rec, _) in zip(prompts, runs):
        host, _ = ddtree_run(e, prompt, pos0, N_TOKENS, builder="host")
        for k in rec:
            assert np.array_equal(rec[k], host[k]), f"{k}: device and host builders differ (pos0 {pos0})"


@pytest.mark.cuda
@pytest.mark.parametrize("bundle", BUNDLES)
def test_every_verified_node_is_an_ar_replay_of_its_path(engine_cls, bundle):
    """Every node of every round of prompt 0, on each bundle: its verify logits vs a float64 AR forward over
    prefix + root + its ancestor path (the bundle's derived ar/logits tolerance, the one kdtr verify judges
    path logits with), and vs the engine's own causal forward over the same tokens (same tolerance). The
    float64 prefix (committed rows + root) is computed once per round and each node's path continues it."""
    from refmodel.stored import read_model
    from conformance.tolerance import check_tap, manifest_rule, resolve_rule
    from cuda_engine.ddtree import ddtree_run
    from refmodel.model import KVCache, forward

    with open_kdtr(bundle) as f:
        cfg, W = read_model(f)
        rule = resolve_rule("ar/logits", manifest_rule(f.metadata["tolerances"]["taps"]["ar/logits"]), [])
        prompt, pos0 = _prompts(f)[0]
    e = engine_cls()
    e.load(bundle)
    _, stats = ddtree_run(e, prompt, pos0, N_TOKENS, keep_logits=True)
    replay = engine_cls()
    replay.load(bundle)
    nodes = 0
    for r in stats["verify"]:
        start, tree, logits = r["start"], r["tree"], r["logits"]
        prefix = np.asarray(r["out"][:start + 1], np.int64)            # committed + the root
        base = KVCache(cfg, np.float64)
        root64, _ = forward(cfg, W, prefix, pos0 + np.arange(len(prefix)), base)
        for i in range(tree.size):
            path, a = [], i
            while a > 0:
                path.append(int(tree.tokens[a - 1]))
                a = int(tree.parents[a])
            path = np.asarray(path[::-1], np.int64)
            ar64 = root64
            if len(path):                                           # continue the prefix, then drop the path rows
                ar64, _ = forward(cfg, W, path, pos0 + len(prefix) + np.arange(len(path)), base)
                base.truncate(len(prefix))
            at = f"{bundle} pos0 {pos0} start {start} node {i}"
            got = check_tap(ar64[-1:], logits[i:i + 1], rule)
            assert got.passed, f"{at}: {got.failures}"
            seq = np.concatenate([prefix, path])
            replay.reset()
            own, _ = replay.prefill(seq, pos0 + np.arange(len(seq)))
            same = check_tap(own[-1:].astype(np.float64), logits[i:i + 1], rule)
            assert same.passed, f"{at} vs the GPU's own AR: {same.failures}"
            nodes += 1
    assert len(stats["verify"]) == stats["rounds"] >= 2 and nodes == sum(r["tree"].size for r in stats["verify"])
    assert max(r["tree"].size for r in stats["verify"]) > 1, "no round drafted a node"


@pytest.mark.cuda
def test_two_runs_and_no_graph_are_identical(tiny_run, engine_cls):
    e, prompts, runs = tiny_run
    plain = engine_cls(use_graph=False)
    plain.load(TINY)
    for (prompt, pos0), (rec, _) in zip(prompts, runs):
        again, nograph = e.ddtree_generate(prompt, pos0, N_TOKENS), plain.ddtree_generate(prompt, pos0, N_TOKENS)
        assert rec.keys() == again.keys() == nograph.keys()
        for k in rec:
            assert np.array_equal(rec[k], again[k]), f"{k} differs between two runs (pos0 {pos0})"
            assert np.array_equal(rec[k], nograph[k]), f"{k} differs without CUDA graphs (pos0 {pos0})"


@pytest.mark.cuda
@pytest.mark.parametrize("bundle", BUNDLES)
def test_verify_passes_with_the_live_ddtree(engine_cls, bundle):
    from conformance.verify.runner import verify

    v = verify(bundle, engine=engine_cls())
    live = [c for c in v.checks if "/ddtree_live/" in c.name]
    assert v.verdict == "pass", [f"{c.name}: {c.message}" for c in v.checks if c.status == "fail"][:5]
    assert {c.name.rsplit("/", 1)[1] for c in live} >= {"tokens", "tokens_vs_own_ar", "trees", "target_forwards"}
    assert all(c.status == "pass" for c in live if not c.name.endswith("path_logits"))


# ------------------------------------------------------------------------------------------------ CLI (CPU)

_NO_PYCUDA = pytest.mark.skipif(importlib.util.find_spec("pycuda") is not None, reason="pycuda is installed here")


@_NO_PYCUDA
def test_bench_ddtree_without_pycuda_says_why():
    from click.testing import CliRunner

    from cli.main import main

    r = CliRunner().invoke(main, ["bench", "ddtree", TINY, "--tokens", "4", "--repeats", "1"])
    assert r.exit_code == 6, r.output
    assert "kdtr bench ddtree: pycuda is not installed" in r.output and "Traceback" not in r.output


def test_bench_ddtree_checks_its_json_path_first(tmp_path):
    from click.testing import CliRunner

    from cli.main import main

    r = CliRunner().invoke(main, ["bench", "ddtree", TINY, "--json", str(tmp_path / "missing" / "b.json")])
    assert r.exit_code == 2 and "--json" in r.output and "Traceback" not in r.output
