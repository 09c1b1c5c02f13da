"""The committed golden bundles: current (they regenerate from their MANIFEST commands and the
regenerated goldens match within the bundles' own tolerances), light to clone, self-consistent, and
passing with the reference engine."""
import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from cli.main import main
from conformance.engines.reference_engine import ReferenceEngine
from conformance.exit_codes import ExitCode
from conformance.gen.manifest import manifest_commands, option, with_option
from conformance.verify.runner import verify
from kdtr_format import open_kdtr

ROOT = Path(__file__).resolve().parent.parent
TINY = ["bundles/model_tiny.kdtr", "bundles/model_int4_tiny.kdtr"]
EDGE = "bundles/model_edge.kdtr"  # every path the CUDA engine ships (docs/golden-bundles.md, "The edge bundle")
SHARDABLE = "bundles/model_shardable_int4.kdtr"   # for sharded engines (docs/golden-bundles.md, "The shardable bundle")
WIDE = "bundles/model_wide.kdtr"  # the entries only K2.6's widths reach (docs/golden-bundles.md, "The wide bundle")
SLICE = "bundles/model_tiny_slice.kdtr"   # stored as K2.6 ships: bf16 dense (docs/golden-bundles.md, "The tiny slice")
BUNDLES = TINY + [EDGE, SHARDABLE, WIDE, SLICE]
MB = 1 << 20
SIZE_BUDGET_MB = {"bundles/model_tiny.kdtr": 20, "bundles/model_int4_tiny.kdtr": 20, EDGE: 12, SHARDABLE: 20,
                  WIDE: 12, SLICE: 8}
FULL_DEPTH_ROUNDS = 3           # the tiny bundles' coverage aim, each (MANIFEST.md has the figures)
MIN_NEW_TOKENS = {EDGE: 32,     # the edge bundle's 5 prompts (one of 34 tokens) keep it within 12 MiB; else 64
                  SHARDABLE: 32,  # the shardable bundle within 20 MiB and the GPU machine's transfer (MANIFEST.md)
                  WIDE: 16}       # the wide bundle's vocabulary of 4160 within 12 MiB


def test_manifest_lists_every_bundle_with_its_sha256():
    import hashlib
    text = (ROOT / "bundles" / "MANIFEST.md").read_text()
    assert set(manifest_commands()) == set(BUNDLES)
    for b in BUNDLES:
        digest = hashlib.sha256((ROOT / b).read_bytes()).hexdigest()
        assert digest in text, f"{b}: sha256 {digest} not in MANIFEST.md (regenerated without updating it?)"


def test_bundles_are_light_to_clone():
    sizes = {b: os.path.getsize(ROOT / b) for b in BUNDLES}
    assert all(sizes[b] <= SIZE_BUDGET_MB[b] * MB for b in BUNDLES), sizes
    assert sum(sizes[b] for b in TINY) <= 32 * MB, sizes


@pytest.mark.parametrize("bundle", BUNDLES)
def test_bundle_records(bundle):
    with open_kdtr(ROOT / bundle, verify=True) as f:
        meta = f.metadata
        lengths = [len(f[f"golden/p{i}/prompt_ids"]) for i in range(meta["prompts"])]
        assert meta["prompts"] >= 5 and 1 in lengths and len(set(lengths)) == len(lengths)
        assert meta["max_new_tokens"] >= MIN_NEW_TOKENS.get(bundle, 64)
        for i in range(meta["prompts"]):
            assert np.array_equal(f[f"golden/p{i}/ddtree/tokens"], f[f"golden/p{i}/ar/tokens"])
        fig = meta["figures"]
        print(f"\n{bundle}: forward ratio {fig['forward_ratio']}, tokens/round {fig['mean_tokens_per_round']}, "
              f"accepted depths {fig['accepted_depth_histogram']}, off-spine rounds {fig['off_spine_rounds']}, "
              f"min margin {fig['min_margin']:.3g}")
        assert fig["forward_ratio"] == round(fig["ar_target_forwards"] / fig["ddtree_target_forwards"], 4)
        # coverage for engines: bonus-only rounds and full-depth rounds (15 draft tokens, the deepest
        # compaction), as MANIFEST.md reports them; off-spine rounds: test_off_spine_rounds_are_covered
        hist = fig["accepted_depth_histogram"]
        assert len(hist) == 16 and hist[15] == fig["full_depth_rounds"]
        if bundle in TINY:                 # the edge bundle is for widths, the shardable one for ranks, not depths
            assert hist[0] > 0 and fig["full_depth_rounds"] >= FULL_DEPTH_ROUNDS
        # one long-position prompt (docs/golden-bundles.md), with DDTree rounds there; decode attn_out
        offs = meta["position_offsets"]
        long = [i for i, o in enumerate(offs) if o]
        assert len(long) == 1 and offs[long[0]] >= 2**17, offs
        assert fig["long_position"]["prompt"] == long[0] and fig["long_position"]["rounds"] >= 2
        assert "attn_out" in meta["taps"]["ar"]


def test_off_spine_rounds_are_covered():
    """The committed bundles hold rounds that accept a node of draft rank >= 1 (the walk leaves the drafter's
    top-1 spine: non-spine compaction and positions). Whether a drafter gives one is close to chance
    (MANIFEST.md): the tiny bundles' drafters distilled under today's pin give none, the edge bundle 3. The
    compaction an engine runs does not depend on the target's numerics (FP32 or INT4), so the set is what
    counts; each bundle's own count is in MANIFEST.md."""
    off = {}
    for b in BUNDLES:
        with open_kdtr(ROOT / b) as f:
            off[b] = f.metadata["figures"]["off_spine_rounds"]
    assert sum(off.values()) > 0, off


def test_the_edge_bundle_reaches_the_edge_paths():
    """What the edge bundle is for (docs/golden-bundles.md, "The edge bundle"): widths that are not multiples
    of the kernels' tiles, a hidden size past one combine block, more than 6 k-splits possible on the expert
    down projection, 9 or more tokens of one forward routed to one expert, tree verifies of many nodes."""
    from refmodel.config import ModelConfig
    with open_kdtr(ROOT / EDGE) as f:
        cfg = ModelConfig.from_dict(f.metadata["model_config"])
        assert (f.metadata.get("quantization") or {}).get("method") == "w4a16"
        assert cfg.hidden_size % 64 and cfg.hidden_size > 256          # 32-row blocks: odd; 2 combine blocks
        assert cfg.moe_intermediate_size % 64 and cfg.moe_intermediate_size // 32 > 6   # 7 groups: 7 splits
        assert cfg.vocab_size % 8
        prompts = range(f.metadata["prompts"])
        most = max(np.bincount(f[f"golden/p{i}/prefill/L{l}/topk_ids"].reshape(-1)).max()
                   for i in prompts for l in range(cfg.first_k_dense_replace, cfg.num_hidden_layers))
        assert most >= 9, f"no prefill routes 9 tokens to one expert (most: {most})"
        widest = max(np.diff(f[f"golden/p{i}/ddtree/tree_offsets"]).max() for i in prompts)
        assert widest >= 9, f"no golden tree verify of 9 or more nodes (widest: {widest})"


def test_the_wide_bundle_reaches_the_k26_entries():
    """What the wide bundle is for (docs/golden-bundles.md, "The wide bundle"): on the H200's 132 SMs its MoE
    decode step and every forward of 2 or more tokens (pairs up to 17 tokens, grouped above) take the fast W4A16
    planner's many-row regime on the 8-row-block entries, as K2.6's MoE layers do, and its vocabulary takes the
    DDTree top-K past the in-block
    sort. The planner is the engine's own (cuda_engine/w4a16_plan.py), at the residency the engine measures
    there (docs/cuda-engine.md); which entries a verify really ran, the proofs record
    (tests/test_cuda_entries_ran.py)."""
    from cuda_engine.drafter import TOPK_SORT_MAX
    from refmodel.config import ModelConfig
    from cuda_oracle import moe_launches
    with open_kdtr(ROOT / WIDE) as f:
        cfg = ModelConfig.from_dict(f.metadata["model_config"])
        assert (f.metadata.get("quantization") or {}).get("method") == "w4a16"
        assert f.metadata["drafter_config"]["vocab_size"] == cfg.vocab_size > TOPK_SORT_MAX
        lengths = [len(f[f"golden/p{i}/prompt_ids"]) for i in range(f.metadata["prompts"])]
    launches = moe_launches(cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts,
                            cfg.num_experts_per_tok, 132, tokens=sorted({1, *lengths, 33}))
    gate_up = {(p, name, regime) for p, w, T, name, _, _, regime in launches if w == "gate_up"}
    assert gate_up == {("pairs", "w4a16_mma_i8_m1_r8", "many_rows"),
                       ("grouped", "w4a16_mma_i8_m4_r8", "many_rows")}, gate_up


def test_the_tiny_slice_is_stored_as_k26_ships():
    """What the tiny slice is for (docs/golden-bundles.md, "The tiny slice"): every matmul weight a K2.6
    checkpoint stores as bfloat16 is bfloat16 here too (what the CUDA engine keeps as bf16 on the device,
    cuda_engine/weights.py BF16_WEIGHTS), through every kind of layer: the dense first layer's MLP, the
    router and the shared expert of the MoE layers; the routed experts INT4."""
    from cuda_engine.weights import BF16_WEIGHTS
    from refmodel.config import ModelConfig
    with open_kdtr(ROOT / SLICE) as f:
        cfg = ModelConfig.from_dict(f.metadata["model_config"])
        dtypes = {n: f.info(n).dtype for n in f.names if not n.startswith(("golden/", "drafter."))}
    assert cfg.first_k_dense_replace == 1 and cfg.num_hidden_layers >= 3 and cfg.n_shared_experts == 1
    matmul = [n for n in dtypes if n.endswith(BF16_WEIGHTS)]
    assert all(dtypes[n] == "bfloat16" for n in matmul), [n for n in matmul if dtypes[n] != "bfloat16"]
    for suffix in BF16_WEIGHTS:                     # every kind of bf16 weight the engine reads is present
        assert any(n.endswith(suffix) for n in matmul), suffix
    assert any(n.startswith("model.layers.1.mlp.shared_experts.") for n in matmul)
    assert any(n.startswith("model.layers.0.mlp.gate_proj") for n in matmul)
    assert {dtypes[n] for n in dtypes if ".experts." in n} == {"int32", "bfloat16"}   # .qw words, .sc scales


@pytest.mark.parametrize("bundle", BUNDLES)
def test_committed_bundle_passes_with_the_reference_engine(bundle):
    v = verify(str(ROOT / bundle), engine=ReferenceEngine())
    assert v.exit_code == ExitCode.OK, [(c.name, c.message) for c in v.checks if c.status != "pass"]


def test_the_manifest_commands_distill_with_numpy_math():
    """The committed drafters regenerate on Intel and AMD CPUs alike only with NumPy's vector math (torch's `exp`
    and AdamW's `sqrt` round by CPU: docs/golden-bundles.md, "Measured on an Intel Xeon"): no MANIFEST command
    names another, and a command without the option gets NumPy's, the default it records in each bundle."""
    from refmodel.distill import DistillSettings
    assert DistillSettings().vector_math == "numpy"
    commands = manifest_commands()
    assert [b for b, argv in commands.items() if option(argv, "--distill-math", "numpy") != "numpy"] == []
    distilled = [b for b, argv in commands.items() if int(option(argv, "--distill-steps", "1000")) > 0]
    assert len(distilled) == 5                                     # model_tiny_slice: --distill-steps 0
    for b in distilled:
        with open_kdtr(ROOT / b) as f:
            assert "--distill-math numpy" in f.metadata["provenance"]["command"], b
    assert option(["--distill-math=torch"], "--distill-math") == "torch"
    assert option(commands[TINY[0]], "--distill-steps") == "1000"
    assert option(commands[TINY[0]], "--no-such-option", "x") == "x"


def test_the_regeneration_plan_orders_and_redirects_the_manifest_commands(tmp_path):
    """bench/regenerate_bundles.py's plan (conformance/gen/manifest.py): every command writes into the chosen
    directory; the INT4 tiny bundle reads the regenerated FP32 one and waits for it when both are regenerated, and
    the committed one when it alone is; an unknown name is refused naming the known ones."""
    from conformance.gen.manifest import plan

    commands = manifest_commands()
    jobs = plan(commands, str(tmp_path))
    assert [j.bundle for j in jobs] == list(commands)

    def paths_out(argv):
        return [a for i, a in enumerate(argv) if i == 0 or argv[i - 1] not in ("--out", "--model")]
    for j in jobs:
        assert option(j.argv, "--out") == j.out == str(tmp_path / Path(j.bundle).name)
        assert paths_out(j.argv) == paths_out(commands[j.bundle])          # nothing but the paths changed
    int4 = next(j for j in jobs if j.bundle == TINY[1])
    assert int4.after == TINY[0] and option(int4.argv, "--model") == str(tmp_path / "model_tiny.kdtr")
    alone = plan(commands, str(tmp_path), ["model_int4_tiny"])
    assert len(alone) == 1 and alone[0].after is None and option(alone[0].argv, "--model") == TINY[0]
    assert [j.bundle for j in plan(commands, str(tmp_path), [SLICE, "model_edge"])] == [EDGE, SLICE]
    with pytest.raises(ValueError, match="no bundle named model_huge in bundles/MANIFEST.md; the bundles are "
                                         "model_tiny, "):
        plan(commands, str(tmp_path), ["model_huge"])


@pytest.mark.slow
def test_bundles_regenerate_from_their_manifest_commands(tmp_path, monkeypatch):
    """CI runs this on every push: the MANIFEST commands, run on this machine, give goldens that match
    the committed ones within the committed tolerances (target and drafter weights bit-exact; the drafters are
    distilled with NumPy's vector math, with which the small pinned distillation gave the same bits on an Intel Xeon
    and an AMD EPYC, and the full regeneration the same figures: docs/golden-bundles.md)."""
    monkeypatch.chdir(ROOT)                                # commands use repo-relative paths
    for bundle, argv in manifest_commands().items():
        out = tmp_path / Path(bundle).name
        r = CliRunner().invoke(main, with_option(argv, "--out", str(out)))
        assert r.exit_code == 0, r.output
        with open_kdtr(bundle) as a, open_kdtr(out) as b:                # name a drafter's drift plainly
            drift = [n for n in a.names if n.startswith("drafter.")
                     and a.info(n).checksum != b.info(n).checksum]
        assert not drift, f"{bundle}: the re-distilled drafter differs ({len(drift)} tensors, e.g. {drift[0]})"
        v = verify(bundle, dump=str(out))
        assert v.exit_code == ExitCode.OK, [(c.name, c.message) for c in v.checks if c.status != "pass"]
        with open_kdtr(bundle) as a, open_kdtr(out) as b:
            weights = [n for n in a.names if not n.startswith("golden/")]
            assert weights == [n for n in b.names if not n.startswith("golden/")]
            for n in weights:
                assert a.info(n).checksum == b.info(n).checksum, n


def test_the_shardable_bundle_divides_over_2_4_and_8_ranks():
    """What the shardable bundle is for (docs/golden-bundles.md, "The shardable bundle"): heads, routed
    experts, expert groups and the sharded widths divide over 2, 4 and 8 ranks; group-limited routing
    (several groups, fewer kept) with INT4 experts and one shared expert; its golden routing uses every group."""
    from refmodel.config import ModelConfig
    with open_kdtr(ROOT / SHARDABLE) as f:
        cfg = ModelConfig.from_dict(f.metadata["model_config"])
        assert (f.metadata.get("quantization") or {}).get("method") == "w4a16"
        for ranks in (2, 4, 8):
            for name in ("num_attention_heads", "n_routed_experts", "n_group", "intermediate_size",
                         "moe_intermediate_size", "vocab_size"):
                assert getattr(cfg, name) % ranks == 0, (name, getattr(cfg, name), ranks)
        assert 1 < cfg.topk_group < cfg.n_group and cfg.n_shared_experts == 1
        per_group = cfg.n_routed_experts // cfg.n_group
        groups = set()
        for i in range(f.metadata["prompts"]):
            for l in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
                groups |= set((np.asarray(f[f"golden/p{i}/prefill/L{l}/topk_ids"]).reshape(-1) // per_group).tolist())
        assert groups == set(range(cfg.n_group)), groups

