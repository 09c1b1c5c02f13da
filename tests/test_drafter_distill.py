"""The drafter: config round trip, the torch training forward against the NumPy drafter (float64), the
batched corpus generator against greedy_generate, the block-anchor loss, determinism, `kdtr distill`."""
import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from click.testing import CliRunner

from cli.main import main
from kdtr_format import open_kdtr, write_kdtr
from refmodel.distill import DistillSettings, batched_greedy, distill_drafter
from refmodel.distill_torch import block_anchor_loss, torch_drafter_logits
from refmodel.drafter import (DrafterCache, DrafterConfig, drafter_forward, drafter_preset, init_drafter,
                              target_features)
from refmodel.generate import greedy_generate
from refmodel.model import forward
from refmodel.weights import init_weights
from test_ddtree_verify import MICRO, MICRO_DRAFTER

SMALL = DistillSettings(sequences=8, batch_gen=4, prompt_len=(1, 4), seq_len=24, batch=4, anchors=2)


def test_config_round_trip_and_validation():
    d = drafter_preset("tiny")
    assert DrafterConfig.from_dict(d.to_dict()) == d
    assert d.block_size == 16 and d.num_hidden_layers == 2 and d.mask_token_id == 399 and d.block_pos_embed
    assert init_drafter(d, 0)["drafter.block_pos_embed"].shape == (16, 192)
    old = {k: v for k, v in d.to_dict().items() if k != "block_pos_embed"}     # bundles made before the field
    assert DrafterConfig.from_dict(old).block_pos_embed is False
    with pytest.raises(ValueError, match=r"target_layer_ids = \[1, 1\]: need distinct layers in \[0, 6\)"):
        DrafterConfig(**{**d.to_dict(), "target_layer_ids": [1, 1]})


@pytest.mark.parametrize("pos_embed", [False, True])
def test_torch_training_forward_equals_numpy_drafter(pos_embed):
    dcfg = DrafterConfig(**{**MICRO_DRAFTER.to_dict(), "block_pos_embed": pos_embed})
    W = init_weights(MICRO, 2)
    DW = init_drafter(dcfg, 2)
    assert ("drafter.block_pos_embed" in DW) == pos_embed
    if pos_embed:
        DW["drafter.block_pos_embed"] *= 10.0        # make the offsets matter in the comparison
    ids = np.random.default_rng(2).integers(0, 47, size=(2, 30))
    feats = np.stack([target_features(dcfg, forward(MICRO, W, s, np.arange(30))[1]) for s in ids])
    anchors = np.array([[1, 9, 22], [4, 5, 17]])
    P = {k: torch.tensor(v) for k, v in DW.items()}
    got = torch_drafter_logits(dcfg, P, torch.tensor(W["model.embed_tokens.weight"]),
                               torch.tensor(W["lm_head.weight"]), torch.tensor(feats), torch.tensor(ids),
                               torch.tensor(anchors)).numpy()                               # [2, 3, 7, V]
    for n in range(2):
        for m, a in enumerate(anchors[n]):
            block = [ids[n, a]] + [dcfg.mask_token_id] * 7
            want = drafter_forward(dcfg, DW, W, block, feats[n, :a], DrafterCache(dcfg), a)
            err = float(np.abs(got[n, m] - want).max())
            assert err <= 1e-10, dict(n=n, anchor=a, err=err)


def test_batched_greedy_equals_greedy_generate():
    W = init_weights(MICRO, 3)
    prompts = np.random.default_rng(3).integers(0, 47, size=(5, 3))
    seq, hiddens = batched_greedy(MICRO, W, prompts, 12)
    for n in range(5):
        assert seq[n, 3:].tolist() == greedy_generate(MICRO, W, prompts[n], 12).tokens
        _, h = forward(MICRO, W, seq[n, :-1], np.arange(14))
        assert max(float(np.abs(a[n] - b).max()) for a, b in zip(hiddens, h)) <= 1e-10


def test_block_anchor_loss_weights_offsets():
    V, L = 5, 3
    logits = torch.zeros(1, 1, L, V, dtype=torch.float64)
    logits[0, 0, 0, 2] = 50.0                        # offset 1 right (loss ~0); offsets 2, 3 uniform
    ids = torch.tensor([[0, 2, 1, 1, 0]])
    loss = block_anchor_loss(logits, ids, torch.tensor([[0]]), gamma=7.0)
    w = np.exp(-np.arange(L) / 7.0)
    assert float(loss) == pytest.approx((w[1] + w[2]) * np.log(V) / w.sum(), rel=1e-12)


def test_block_anchor_loss_prefix_only_drops_rows_after_the_first_miss():
    V, L = 5, 4
    logits = torch.zeros(2, 1, L, V, dtype=torch.float64)
    logits[:, 0, 0, 2] = 50.0                        # offset 1: top-1 2, right in both blocks
    logits[:, 0, 1, 3] = 50.0                        # offset 2: top-1 3, wrong in block 0, right in block 1
    ids = torch.tensor([[0, 2, 1, 1, 0], [0, 2, 3, 4, 0]])      # offsets 3, 4 uniform: CE log V
    full = block_anchor_loss(logits, ids, torch.tensor([[0], [0]]), gamma=7.0)
    loss = block_anchor_loss(logits, ids, torch.tensor([[0], [0]]), gamma=7.0, after_miss=0.0)
    w = np.exp(-np.arange(L) / 7.0)
    miss = 50.0 + np.log1p((V - 1) * np.exp(-50.0))  # CE of a confident wrong top-1
    # block 0: rows 1, 2 count (row 2 is the first miss), rows 3, 4 do not; block 1: rows 1-3 (row 3 misses)
    assert float(loss) == pytest.approx((w[1] * miss + w[2] * np.log(V)) / (2 * w.sum()), rel=1e-9)
    assert float(full) == pytest.approx((w[1] * miss + 2 * (w[2] + w[3]) * np.log(V)) / (2 * w.sum()), rel=1e-9)


def test_distill_is_deterministic_and_returns_every_weight():
    W = init_weights(MICRO, 0)
    a = distill_drafter(MICRO, W, MICRO_DRAFTER, seed=5, steps=4, settings=SMALL)
    b = distill_drafter(MICRO, W, MICRO_DRAFTER, seed=5, steps=4, settings=SMALL)
    c = distill_drafter(MICRO, W, MICRO_DRAFTER, seed=6, steps=4, settings=SMALL)
    init = init_drafter(MICRO_DRAFTER, 5)
    assert set(a) == set(init) and all(a[k].dtype == np.float64 and a[k].shape == init[k].shape for k in a)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not all(np.array_equal(a[k], c[k]) for k in a)
    assert not all(np.array_equal(a[k], init[k]) for k in a)     # it trained


def _micro_model_file(path, with_drafter_config=True):
    W = init_weights(MICRO, 0)
    meta = {"model_config": MICRO.to_dict()}
    if with_drafter_config:
        meta["drafter_config"] = MICRO_DRAFTER.to_dict()
    write_kdtr(path, {k: v.astype(np.float32) for k, v in W.items()}, meta)


def test_kdtr_distill_writes_the_drafter_into_the_model(tmp_path, monkeypatch):
    import refmodel.distill as distill

    small = tuple(getattr(SMALL, f.name) for f in dataclasses.fields(SMALL))   # a tiny corpus: the CLI path,
    monkeypatch.setattr(distill.DistillSettings.__init__, "__defaults__", small)   # quickly (the class itself
                                                                                   # stays: its instances pickle)
    src, out = tmp_path / "m.kdtr", tmp_path / "d.kdtr"
    _micro_model_file(src)
    res = CliRunner().invoke(main, ["distill", str(src), "--steps", "3", "--seed", "1", "--out", str(out)])
    assert res.exit_code == 0, res.output
    with open_kdtr(src) as f0, open_kdtr(out, verify=True) as f:
        assert [n for n in f.names if not n.startswith("drafter.")] == f0.names
        assert all(np.array_equal(f[n], f0[n]) for n in f0.names)
        assert {n for n in f.names if n.startswith("drafter.")} == set(init_drafter(MICRO_DRAFTER, 0))
        assert f.info("drafter.fc.weight").dtype == "float64"
        assert DrafterConfig.from_dict(f.metadata["drafter_config"]) == MICRO_DRAFTER
        assert f.metadata["drafter_distill"]["steps"] == 3 and f.metadata["drafter_distill"]["seed"] == 1
        assert f.metadata["drafter_distill"]["settings"]["vector_math"] == "numpy"      # the default, recorded
    res = CliRunner().invoke(main, ["distill", str(src), "--steps", "3", "--seed", "1", "--out", str(out),
                                    "--distill-math", "torch"])
    assert res.exit_code == 0, res.output
    with open_kdtr(out, verify=True) as f:
        assert f.metadata["drafter_distill"]["settings"]["vector_math"] == "torch"


def test_kdtr_distill_rejects_a_file_without_model_config(tmp_path):
    p = tmp_path / "x.kdtr"
    write_kdtr(p, {"w": np.zeros(2, np.float32)}, {"note": "not a model"})
    res = CliRunner().invoke(main, ["distill", str(p), "--steps", "1"])
    assert res.exit_code == 5
    assert f"error: {p} has no model_config in its metadata" in res.output


# ---- the corpus: sized by the run it feeds ----------------------------------------------------------

def _manifest_distill_steps() -> list[int]:
    """--distill-steps of every committed bundle command that distills (bundles/MANIFEST.md)."""
    import os
    import re
    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bundles",
                             "MANIFEST.md")).read()
    return [int(m) for m in re.findall(r"^\s+kdtr gen .*--distill-steps (\d+)", text, re.M) if int(m) > 0]


def test_the_committed_bundles_corpus_stays_the_one_they_were_distilled_on():
    """The committed drafters were distilled on 1280 streams (the 1000-step tiny and edge bundles) and 384
    (the 300-step shardable bundle, generated with the corpus already sized by its steps): their commands must
    still get exactly those, or the regeneration would give other drafters."""
    from refmodel.distill import corpus_size
    made_on = {1000: 1280, 300: 384}                        # steps -> streams, as each bundle was distilled
    steps = _manifest_distill_steps()
    assert steps and set(steps) <= set(made_on), steps
    assert made_on[1000] == DistillSettings().sequences
    for n in steps:
        assert corpus_size(dataclasses.replace(DistillSettings(), steps=n)) == made_on[n], n


@pytest.mark.parametrize("steps, streams", [(1, 8), (20, 32), (100, 128), (999, 1280), (1000, 1280), (5000, 1280)])
def test_a_short_run_gets_a_corpus_of_its_draws(steps, streams):
    """steps x batch draws, 6.25 per stream (the measured run's rate), whole batches of 8, at most 1280."""
    from refmodel.distill import corpus_size
    assert corpus_size(dataclasses.replace(DistillSettings(), steps=steps)) == streams


def test_a_smaller_corpus_is_a_prefix_of_the_full_one():
    """Sizing changes how many streams are made, never which: the first streams are the same draws."""
    from refmodel.distill import make_corpus
    W = init_weights(MICRO, 0)
    full = dataclasses.replace(SMALL, sequences=16, steps=100)           # 100 x 4 / 6.25 -> 64, capped at 16
    short = dataclasses.replace(SMALL, sequences=16, steps=8)            # 8 x 4 / 6.25 = 5.1 -> 8 (whole batches)
    seen = []
    a = make_corpus(MICRO, W, MICRO_DRAFTER, 3, full)
    b = make_corpus(MICRO, W, MICRO_DRAFTER, 3, short, lambda stage, done, total, _: seen.append((done, total)))
    assert len(a[0]) == 16 and len(b[0]) == 8 and seen[-1] == (8, 8)
    for x, y in zip(a, b):
        assert np.array_equal(x[:8], y)


@pytest.mark.parametrize("workers", [2, 3])
def test_the_corpus_is_the_same_bits_made_by_several_processes(workers):
    """make_corpus hands its batches to forked processes (one per CPU by default): the prompts are drawn in
    order before any batch runs, and each batch is one single-threaded NumPy run, so the corpus does not
    depend on how many processes made it, nor on the order they finish in."""
    from refmodel.distill import make_corpus
    W = init_weights(MICRO, 0)
    s = dataclasses.replace(SMALL, sequences=40, steps=100)               # 10 batches of 4 (batch_gen)
    seen = []
    one = make_corpus(MICRO, W, MICRO_DRAFTER, 5, s, workers=1)
    many = make_corpus(MICRO, W, MICRO_DRAFTER, 5, s, lambda stage, done, total, _: seen.append(done),
                       workers=workers)
    assert len(one[0]) == 40 and seen == sorted(seen) and seen[-1] == 40
    for x, y in zip(one, many):
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
