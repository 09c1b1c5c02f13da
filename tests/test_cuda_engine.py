"""CudaEngine end to end: the committed bundles pass, runs are bit-identical, the graph changes no bit,
teacher forcing works; and (CPU) unsupported configs fail with the field and the limit."""
import dataclasses

import numpy as np
import pytest

from cuda_engine.proofs import is_int4
from cuda_oracle import committed_bundles, gpu_ops
from refmodel.config import PRESETS

BUNDLES = committed_bundles()
INT4_BUNDLES = [b for b in BUNDLES if is_int4(b)]


@pytest.fixture(scope="module")
def engine_cls():
    gpu_ops()                                                    # skips without pycuda / a device
    from cuda_engine.engine import CudaEngine

    return CudaEngine


def collect_with(engine, bundle):
    from conformance.verify.collect import collect
    from kdtr_format import open_kdtr

    with open_kdtr(bundle) as f:
        engine.load(f)
        return collect(engine, f)


@pytest.mark.cuda
@pytest.mark.parametrize("bundle", BUNDLES)
def test_bundle_passes(engine_cls, bundle):
    from conformance.verify.runner import verify

    v = verify(bundle, engine=engine_cls())
    bad = [f"{c.name}: {c.message or c.metrics}" for c in v.checks if c.status != "pass" and c.status != "skip"]
    assert v.verdict == "pass", f"{bundle}: exit {int(v.exit_code)}; first problems: {bad[:5]}"


@pytest.mark.cuda
@pytest.mark.parametrize("bundle", INT4_BUNDLES)
def test_int4_bundle_passes_on_dequantized_weights_too(engine_cls, bundle):
    """--w4a16 dense: the INT4 experts dequantized at load and run by the dense kernels."""
    from conformance.verify.runner import verify

    v = verify(bundle, engine=engine_cls(w4a16="dense"))
    assert v.verdict == "pass", f"{bundle} (w4a16 dense): exit {int(v.exit_code)}"


@pytest.mark.cuda
@pytest.mark.parametrize("bundle", INT4_BUNDLES)
def test_int4_bundle_passes_on_the_plain_kernel(engine_cls, bundle):
    """--w4a16 plain: the packed weights as stored (w4a16_plain.cu); the default (fast) is test_bundle_passes."""
    from conformance.verify.runner import verify

    v = verify(bundle, engine=engine_cls(w4a16="plain"))
    assert v.verdict == "pass", f"{bundle} (w4a16 plain): exit {int(v.exit_code)}"


@pytest.mark.cuda
def test_fast_w4a16_runs_identical_and_graph_changes_no_bit(engine_cls):
    """The fast kernel's split-K (partials summed by the last block, tickets reset for the next replay) gives
    the same bits on every run and inside the replayed decode graph."""
    bundle = "bundles/model_int4_tiny.kdtr"
    a = collect_with(engine_cls(w4a16="fast"), bundle)
    b = collect_with(engine_cls(w4a16="fast"), bundle)
    c = collect_with(engine_cls(w4a16="fast", use_graph=False), bundle)
    for k in a:
        assert np.array_equal(a[k], b[k]), f"{k} differs between two identical runs"
        assert np.array_equal(a[k], c[k]), f"{k} differs with and without the CUDA graph"


@pytest.mark.cuda
def test_two_runs_identical_and_graph_changes_no_bit(engine_cls):
    bundle = "bundles/model_tiny.kdtr"
    a = collect_with(engine_cls(), bundle)
    b = collect_with(engine_cls(), bundle)
    c = collect_with(engine_cls(use_graph=False), bundle)
    assert a.keys() == b.keys() == c.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), f"{k} differs between two identical runs"
        assert np.array_equal(a[k], c[k]), f"{k} differs with and without the CUDA graph"


@pytest.mark.cuda
@pytest.mark.parametrize("bundle", ["bundles/model_tiny.kdtr", "bundles/model_int4_tiny.kdtr"])
def test_programmatic_dependencies_change_no_bit(engine_cls, bundle, monkeypatch):
    """The engine's graphs may make every kernel -> kernel edge programmatic (cuda_engine/graph.py): a kernel's
    blocks may be scheduled before the kernel before it ends, and AFTER_PREVIOUS_GRID() holds them until it has.
    A kernel that read early would show here: runs (decode graph, DDTree round graphs) with "late" and "early"
    programmatic edges give the bits of a run whose graphs have plain edges; and on sm_90 every edge of the
    decode step's chain is programmatic."""
    import cuda_engine.graph as graph_mod

    runs = {}
    for edges in ("plain", "late", "early"):
        monkeypatch.setattr(graph_mod, "GRAPH_EDGES", edges)
        e = engine_cls()
        runs[edges] = collect_with(e, bundle)
        want = 0 if edges == "plain" or e.ops.cc_major < 9 else e.graph.launches - 1
        assert e.graph is not None and e.graph.programmatic == want, (
            f"{edges}: {e.graph.programmatic} programmatic edges in a decode graph of {e.graph.launches} kernels")
    a = runs["plain"]
    for edges in ("late", "early"):
        assert a.keys() == runs[edges].keys()
        for k in a:
            assert np.array_equal(a[k], runs[edges][k]), f"{k} differs with {edges} programmatic edges"


@pytest.mark.cuda
def test_growing_buffers_change_no_bit(engine_cls, monkeypatch):
    """Capacities of 2 tokens and 4 cache rows force every reallocation path (activations, the cache with
    its rows copied, the graph re-captured): the run is bit-identical to one that never reallocates."""
    import cuda_engine.engine as ce

    a = collect_with(engine_cls(), "bundles/model_tiny.kdtr")
    monkeypatch.setattr(ce, "T_CAP0", 2)
    monkeypatch.setattr(ce, "S_CAP0", 4)
    b = collect_with(engine_cls(), "bundles/model_tiny.kdtr")
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), f"{k} differs after reallocations"


@pytest.mark.cuda
def test_run_layer_reproduces_the_forward(engine_cls):
    """run_layer on the engine's own layer input and cache rows gives the forward's taps bit for bit."""
    from cuda_engine.ops import join3
    from kdtr_format import open_kdtr

    e = engine_cls()
    with open_kdtr("bundles/model_tiny.kdtr") as f:
        e.load(f)
        prompt = max((np.asarray(f[n]) for n in f.names if n.endswith("/prompt_ids")), key=len)
    P, L = len(prompt), e.cfg.num_hidden_layers
    assert P >= 3, "the bundle needs a prompt of 3+ tokens for this test"
    e.prefill(prompt[:-2], np.arange(P - 2))
    C = e.cfg.kv_lora_rank
    rows = [join3(e.cache["kv"].view(l).get()[:, :P - 2]) for l in range(L)]   # the cached values, from their terms
    ckv = [r[:, :C] for r in rows]
    kpe = [r[:, C:C + e.cfg.qk_rope_head_dim] for r in rows]
    _, taps = e.prefill(prompt[-2:], np.arange(P - 2, P))                # 2 new rows over a cache of P - 2
    for l in range(1, L):                                                # layer 0's input is the embedding
        local = e.run_layer(l, {"hidden": taps[f"L{l - 1}/resid_out"], "positions": np.arange(P - 2, P),
                                "c_kv": ckv[l], "k_pe": kpe[l]})
        assert local.keys() == {k for k in taps if k.startswith(f"L{l}/")}
        for k, v in local.items():
            assert np.array_equal(v, taps[k]), f"run_layer {k} differs from the forward"


def test_unsupported_config_names_the_field_and_limit():
    from cuda_engine.device import CudaEngineError
    from cuda_engine.engine import check_config

    check_config(PRESETS["k26"])
    with pytest.raises(CudaEngineError, match=r"unsupported config: n_routed_experts = 2048 exceeds the CUDA "
                                              r"engine's limit 1024"):
        check_config(dataclasses.replace(PRESETS["k26"], n_routed_experts=2048, n_group=1))
    with pytest.raises(CudaEngineError, match=r"unsupported config: kv_lora_rank = 1024 exceeds the CUDA engine's "
                                              r"limit 512"):
        check_config(dataclasses.replace(PRESETS["k26"], kv_lora_rank=1024))


@pytest.mark.cuda
def test_graph_capture_survives_a_dropped_engines_garbage(engine_cls):
    """A dropped engine caught in a reference cycle is freed by Python's cycle collector, whenever that runs.
    If it ran during a stream capture, cuMemFree would invalidate the capture (the suite once failed so, one
    engine after another in one process). With the collector set to run at nearly every allocation, the
    second engine's decode graph is still captured and its run matches the first engine's."""
    import gc

    bundle = "bundles/model_tiny.kdtr"
    first = engine_cls()
    a = collect_with(first, bundle)
    first.cycle = first                                          # only the cycle collector can free it now
    del first
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        b = collect_with(engine_cls(), bundle)
    finally:
        gc.set_threshold(*threshold)
    for k in a:
        assert np.array_equal(a[k], b[k]), f"{k} differs after a capture next to collectable garbage"
