"""CudaEngine.hold_routing (GPU): the MoE runs the held expert ids, weighted from the engine's own router
scores there, while the router_scores / topk_ids / topk_weights taps still report its own choice; the held
ids live in a device buffer the decode graph reads, reset to "router decides" after every held forward.

- held sets that are NOT the router's choice (every row's K-th golden expert swapped for the best one
  outside the golden set) give the reference engine's taps, held alike, within the bundle's tolerances, in
  prefill and in graph-replayed decode steps, and the next unheld decode step runs the router's own choice
  again (no stale ids in the graph);
- a run held to the golden sets (the committed INT4 bundle, copied with `tolerances.routing: "held"`, as
  `kdtr gen --routing-near-ties held` writes it) passes, and says it was held.

GPU only: skipped cleanly without pycuda or a device (tests/cuda_oracle.py).
"""
import numpy as np
import pytest

from cuda_oracle import gpu_ops

pytestmark = pytest.mark.cuda
BUNDLES = ["bundles/model_tiny.kdtr", "bundles/model_int4_tiny.kdtr"]


@pytest.fixture(scope="module")
def engine_cls():
    gpu_ops()                                                    # skips without pycuda / a device
    from cuda_engine.engine import CudaEngine

    return CudaEngine


def other_sets(f, g: str, phase: str, cfg) -> dict:
    """{layer: [T, K]}: the golden expert sets of `phase` with, in every row, the K-th expert (by golden
    biased score) replaced by the best one outside the set: held sets the router would not choose."""
    K, held = cfg.num_experts_per_tok, {}
    for l in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        bias = np.asarray(f.get(f"model.layers.{l}.mlp.gate.e_score_correction_bias"), np.float64)
        choice = np.asarray(f[g + f"{phase}/L{l}/router_scores"], np.float64) + bias          # [T, E]
        order = np.argsort(-choice, axis=-1, kind="stable")                                     # [T, E]
        ids = order[:, :K].copy()
        ids[:, K - 1] = order[:, K]
        held[l] = ids.astype(np.int64)
    return held


def run(engine, f, g: str, held_prefill: dict, held_ar: dict, tokens, steps: int) -> list[dict]:
    """Prefill held, `steps` decode steps held (T = 1: the CUDA engine replays its graph), then one decode
    step free. Returns each forward's taps (logits included)."""
    prompt = np.asarray(f[g + "prompt_ids"])
    P = len(prompt)
    engine.load(f)
    engine.hold_routing(held_prefill)
    logits, taps = engine.prefill(prompt, np.arange(P))
    out = [dict(taps, logits=np.asarray(logits))]
    for s in range(steps + 1):
        if s < steps:
            engine.hold_routing({l: v[s:s + 1] for l, v in held_ar.items()})
        logits, taps = engine.decode(int(tokens[s]), P + s)
        out.append(dict(taps, logits=np.asarray(logits)))
    return out


@pytest.mark.parametrize("bundle", BUNDLES)
def test_held_ids_run_as_the_reference_runs_them(engine_cls, bundle):
    from conformance.engines.reference_engine import ReferenceEngine
    from conformance.tolerance import check_tap, manifest_rule, resolve_rule
    from kdtr_format import open_kdtr
    from refmodel.config import ModelConfig

    steps = 2
    with open_kdtr(bundle) as f:
        cfg, man = ModelConfig.from_dict(f.metadata["model_config"]), f.metadata["tolerances"]["taps"]
        g = "golden/p1/"
        tokens = np.asarray(f[g + "ar/tokens"])
        held_prefill, held_ar = other_sets(f, g, "prefill", cfg), other_sets(f, g, "ar", cfg)
        cuda, ref = engine_cls(), ReferenceEngine()
        got = run(cuda, f, g, held_prefill, held_ar, tokens, steps)
        want = run(ref, f, g, held_prefill, held_ar, tokens, steps)
    assert cuda.held_rows == ref.held_rows > 0                          # the held sets were not its own
    problems = []
    for n, (a, b) in enumerate(zip(got, want)):
        phase = "prefill" if n == 0 else "ar"
        for key, expected in b.items():
            entry = man.get(f"{phase}/{key}") or man.get(f"prefill/{key}")  # decode: the prefill rule where
            if key not in a:                                                # the bundle records no ar/ tap
                problems.append(f"forward {n}: {key} missing")
                continue
            if key.endswith("/topk_ids"):                                   # its own choice, as the reference's
                if not np.array_equal(np.sort(a[key], -1), np.sort(expected, -1)):
                    problems.append(f"forward {n}: {key} {a[key].tolist()} != reference {expected.tolist()}")
                continue
            r = check_tap(np.asarray(expected, np.float64), np.asarray(a[key]), resolve_rule(key, manifest_rule(entry)))
            if not r.passed:
                problems.append(f"forward {n} ({'held' if n <= steps else 'free'}): {key}: {'; '.join(r.failures)}")
    assert not problems, f"{bundle}: {len(problems)} taps differ: {problems[:6]}"


def test_a_held_run_on_the_int4_bundle_passes(engine_cls, tmp_path):
    from conformance.verify.runner import verify
    from kdtr_format import Tensor, open_kdtr, write_kdtr

    src, dst = "bundles/model_int4_tiny.kdtr", tmp_path / "held.kdtr"
    with open_kdtr(src) as f:
        meta = dict(f.metadata, tolerances=dict(f.metadata["tolerances"], routing="held"))

        def tensors():
            for n in f.names:
                info = f.info(n)
                yield n, Tensor(np.asarray(f[n]), dtype=info.dtype, int4_shape=info.int4_shape)
        write_kdtr(dst, tensors(), meta)
    e = engine_cls()
    v = verify(str(dst), engine=e)
    bad = [f"{c.name}: {c.message or c.metrics}" for c in v.checks if c.status not in ("pass", "skip")]
    assert v.info["profile"] == "fp32" and v.info["routing"].startswith("held to the golden expert sets"), v.info
    assert v.verdict == "pass", f"exit {int(v.exit_code)}; first problems: {bad[:5]}"
