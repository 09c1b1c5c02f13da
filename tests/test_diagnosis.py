"""The diagnosis (docs/diagnosis.md): the library's layer is the reference's; every planted mistake is
named top-1 on the small fixture bundles; faults outside the library and honest engines get no
"matched"; the findings reach the JSON, JUnit, HTML and console reports, from a live engine and from a
run dump."""
import json

import numpy as np
import pytest
from rich.console import Console

from conformance.engines.faults import FaultyEngine
from conformance.engines.honest import VARIANTS, HonestEngine
from conformance.engines.mistakes import PLANTED, MistakeEngine
from refmodel.stored import read_model
from conformance.records import prompts_of
from conformance.report.console import print_console
from conformance.report.html import write_html
from conformance.report.verdict import write_json, write_junit
from conformance.verify.collect import collect
from conformance.verify.diagnose import BY_ID, HYPOTHESES, closeness
from conformance.verify.diagnose.layer import Layer
from conformance.verify.runner import verify
from kdtr_format import open_kdtr
from refmodel.model import KVCache, block, causal_mask, rope_cos_sin

ISSUE_IDS = ("rope-layout rope-theta rope-float32-angles yarn-not-applied yarn-mscale yarn-truncate position-offset "
             "causal-mask softmax-scale latent-norm-eps norm-missing kv-write-index kv-compaction router-softmax "
             "router-bias-in-weights router-no-renorm router-no-scaling router-group-limit topk-k-minus-1 "
             "shared-expert-dropped shared-expert-scaled int4-nibble-order int4-zero-point int4-group-index "
             "int4-scale-dtype numerics-bf16 numerics-tf32 tree-positions tree-mask tree-tie-order").split()


@pytest.fixture(scope="module")
def runs(small_bundle, small_int4_bundle):
    """verify() of an engine on the fp32 or int4 fixture, memoised per module."""
    cache = {}

    def run(key, quant, make):
        if (key, quant) not in cache:
            cache[key, quant] = verify(str(small_bundle if quant == "fp32" else small_int4_bundle), engine=make())
        return cache[key, quant]
    return run


def test_the_library_names_every_mistake_and_plants_each():
    assert set(ISSUE_IDS) <= set(BY_ID) and len(BY_ID) == len(HYPOTHESES)
    assert set(PLANTED) == set(BY_ID)
    for h in HYPOTHESES:
        assert h.title and h.taps and set(h.phases) <= {"prefill", "ar", "ddtree"}, h
        assert h.variants or h.tree or h.signatures, h.id


@pytest.mark.parametrize("layer, T, S0", [(0, 3, 0), (1, 4, 0), (1, 1, 5), (2, 2, 3)])
def test_the_split_layer_is_the_references_block_bit_for_bit(small_int4_bundle, layer, T, S0):
    with open_kdtr(small_int4_bundle) as f:
        cfg, W = read_model(f, np.float64)
        rng = np.random.default_rng(layer * 10 + T)
        h, pos = rng.standard_normal((T, cfg.hidden_size)), 7 + np.arange(T)
        c0, k0 = rng.standard_normal((S0, cfg.kv_lora_rank)), rng.standard_normal((S0, cfg.qk_rope_head_dim))
        cache = KVCache(cfg)
        cache.c_kv[layer], cache.k_pe[layer] = c0.copy(), k0.copy()
        taps = {}
        block(cfg, W, layer, h, *rope_cos_sin(cfg, pos), cache, causal_mask(T, S0), False, taps)
        mine = Layer(cfg, W).run(layer, {"hidden": h, "positions": pos, "c_kv": c0, "k_pe": k0})
    assert sorted(mine) == sorted(k.split("/")[1] for k in taps)
    for k, v in taps.items():
        assert np.array_equal(mine[k.split("/")[1]], v), k


@pytest.mark.parametrize("mistake", sorted(PLANTED))
def test_every_planted_mistake_is_named_first(runs, mistake):
    make, where = PLANTED[mistake]
    v = runs(mistake, "int4" if where == "int4" else "fp32", make)
    ids = [(x["id"], x["kind"]) for x in v.diagnosis]
    print(f"\n{mistake}: first divergence {v.first_divergence and v.first_divergence.name}; diagnosis {ids}")
    assert v.verdict == "fail" and v.diagnosis, ids
    kind = "consistent" if mistake == "tree-tie-order" else "matched"   # a signature is its only evidence
    assert ids[0] == (mistake, kind), ids
    assert all(k == "consistent" for _, k in ids[1:]) or mistake.startswith(("int4", "yarn")), ids


@pytest.mark.parametrize("fault, layer", [("scale_tap", 1), ("swap_expert", 2), ("decode_attn_scale", 3)])
def test_a_fault_outside_the_library_is_no_known_mistake(runs, fault, layer):
    v = runs(f"{fault}@{layer}", "fp32", lambda: FaultyEngine(fault, layer))
    assert v.verdict == "fail" and v.first_divergence is not None
    assert not [x for x in v.diagnosis if x["kind"] == "matched"], v.diagnosis


@pytest.mark.parametrize("variant", ("reference",) + VARIANTS)
def test_honest_engines_pass_and_no_mistake_sits_closer_to_them(small_bundle, variant):
    """Evaluated at every tap of layers 0 and 1 (prefill and decode step 0) whether or not it failed: no
    hypothesis matches, and none is 4x closer to the engine than the correct reference."""
    from conformance.engines.reference_engine import ReferenceEngine
    from conformance.verify.context import Run
    from conformance.verify.judge import judge
    e = ReferenceEngine() if variant == "reference" else HonestEngine(variant)
    with open_kdtr(small_bundle) as f:
        e.load(f)
        out = collect(e, f)
        checks, _ = judge(Run.of(f), out)
        assert not [c.name for c in checks if c.status == "fail"]
        _no_mistake_closer(closeness(e, f, out, _places(f, prompts_of(f)[:2])))


def test_the_reports_carry_the_diagnosis(runs, tmp_path):
    v = runs("router-no-renorm", "fp32", lambda: MistakeEngine("router-no-renorm"))
    write_json(v, tmp_path / "v.json")
    write_junit(v, tmp_path / "v.xml")
    write_html(v, tmp_path / "v.html")
    d = json.loads((tmp_path / "v.json").read_text())["diagnosis"]
    assert [sorted(x) for x in d] == [["evidence", "id", "kind", "score", "title"]] * len(d)
    assert d[0]["id"] == "router-no-renorm" and d[0]["kind"] == "matched" and d[0]["score"] > 4
    xml = (tmp_path / "v.xml").read_text()
    assert 'name="diagnosis" value="diagnosis: router-no-renorm (matched' in xml
    assert "<h2>Diagnosis</h2>" in (tmp_path / "v.html").read_text()
    console = Console(record=True, width=400)
    print_console(v, console)
    lines = console.export_text().splitlines()
    at = next(n for n, s in enumerate(lines) if s.startswith("first divergence:"))
    diag = next(n for n, s in enumerate(lines) if s.strip().startswith("diagnosis: router-no-renorm (matched"))
    assert at < diag < at + 8 and sum("diagnosis:" in s for s in lines) == 1


def test_no_known_mistake_is_said_so(runs, tmp_path):
    v = runs("scale_tap@1", "fp32", lambda: FaultyEngine("scale_tap", 1))
    write_json(v, tmp_path / "v.json")
    assert json.loads((tmp_path / "v.json").read_text())["diagnosis"] == []
    console = Console(record=True, width=400)
    print_console(v, console)
    assert "diagnosis: no known mistake explains it" in console.export_text()


def test_a_passing_verdict_has_no_diagnosis(small_bundle):
    from conformance.engines.reference_engine import ReferenceEngine
    v = verify(str(small_bundle), engine=ReferenceEngine())
    assert v.verdict == "pass" and v.diagnosis is None


def test_a_run_dump_is_diagnosed_on_its_own_taps(small_int4_bundle, tmp_path):
    dump = tmp_path / "nibbles.kdtr"
    live = verify(str(small_int4_bundle), engine=FaultyEngine("nibble_order"), save_dump=str(dump))
    v = verify(str(small_int4_bundle), dump=str(dump))
    assert live.diagnosis[0]["id"] == v.diagnosis[0]["id"] == "int4-nibble-order"
    assert "on the engine's own reported inputs" in v.diagnosis[0]["evidence"]


def _places(f, prompts, layers=(0, 1)):
    from refmodel.config import ModelConfig
    from refmodel.model import tap_names
    cfg = ModelConfig.from_dict(f.metadata["model_config"])
    return [(i, ph, l, t, None if ph == "prefill" else 0) for i in prompts for ph in ("prefill", "ar")
            for l in layers for t in tap_names(cfg, l) if ph == "prefill" or t in f.metadata["taps"]["ar"]]


def _no_mistake_closer(rows):
    from conformance.verify.diagnose.evaluate import CLOSER
    assert rows and not [r for r in rows if r[4]]
    closer = [r for r in rows if r[3] > 0 and r[2] * CLOSER <= r[3]]   # (0, 0): no difference to tell
    assert not closer, closer[:5]


@pytest.mark.parametrize("proof", ["model_tiny.cuda", "model_int4_tiny.cuda", "model_int4_tiny.cuda-plain"])
def test_the_committed_cuda_proofs_pass_and_no_mistake_sits_closer(proof):
    """The CUDA engine's committed run dumps (fast and plain W4A16): judged from the dump alone."""
    from conformance.records import read_dump
    bundle, dump = f"bundles/{proof.split('.')[0]}.kdtr", f"bundles/proofs/{proof}.kdtr"
    v = verify(bundle, dump=dump)
    assert v.verdict == "pass" and v.diagnosis is None, [c.name for c in v.checks if c.status == "fail"][:5]
    out, dtype = read_dump(dump)
    with open_kdtr(bundle) as f:
        _no_mistake_closer(closeness(None, f, out, _places(f, prompts_of(f)[:2]), dtype=dtype))


def test_transformers_float32_has_no_mistake_on_the_prompts_it_passes(small_bundle):
    pytest.importorskip("transformers")
    import torch
    from conformance.engines.torch_engine import TorchEngine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                                             # tiny ops: see tests/test_torch_engine.py
    try:
        e = TorchEngine("float32")
        with open_kdtr(small_bundle) as f:
            e.load(f)
            out = collect(e, f)
            ordinary = [i for i, o in enumerate(f.metadata["position_offsets"]) if not o]
            _no_mistake_closer(closeness(e, f, out, _places(f, ordinary[:2])))
    finally:
        torch.set_num_threads(threads)


def test_the_planted_and_the_hypothesised_tf32_roundings_agree():
    """Written twice on purpose (the planted mistake must not share the hypothesis's code): bit trick and
    frexp agree, on random values and on exact ties (the low 13 bits 0x1000: to even)."""
    from conformance.engines.mistakes import _tf32
    from conformance.verify.diagnose.variants_moe import tf32_round
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(20000) * 10.0 ** rng.integers(-8, 8, 20000)).astype(np.float32)
    ties = ((rng.integers(0x00800000, 0x7F000000, 2000, dtype=np.uint32) & ~np.uint32(0x1FFF)) | 0x1000).view(np.float32)
    for a in (x, ties, -ties):
        assert np.array_equal(tf32_round(a), _tf32(a).astype(np.float64))
