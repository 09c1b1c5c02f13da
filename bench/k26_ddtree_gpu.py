"""`kdtr bench ddtree --k26`, the device half: random-weight K2.6 MoE layers at true dims, timed on the
CUDA engine's own layer code (CudaEngine._layer), one CUDA graph per measurement (docs/k26-scale.md).

The engine is assembled here without a bundle: PRESETS["k26"] cut to `layers` layers, all of them MoE
(the dense first layer of K2.6 left out), each with its own attention weights (random, scaled by 1/sqrt(fan-in);
held as bf16 as K2.6 stores them and the engine keeps them, or widened to float32 with dense="float32"), its
router (random gate, zero bias) and its own stack of 384 + 1 INT4 experts in the fast
layout (the shared expert stacked last, on the INT4 path like the routed ones, as `kdtr bench w4a16` holds
it). Timing does not depend on weight values: every expert of a stack holds the same random words (one
expert made on the host, copied on the device), scales 2^-9. The latent cache holds a constant.

Per measurement: the layer's inputs are written (random rows, positions, the tree mask, held expert ids for
the correlated model, else the router's own choice), the launch sequence runs once uncaptured (it reserves
the split-K workspace and surfaces a fault), is captured, replayed twice, then `reps` times between CUDA
events; time = event time / reps. The MoE half alone (router, experts, combine: the engine's calls, copied)
is timed the same way; attention = the layer less that. A failing measurement records its error and the
run goes on; so does a run past its time budget, which skips what is left.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from bench.k26_ddtree import route_tree, tree_mask

SCALE_BITS = 0x3B003B00          # two bf16 scales of 2^-9 in one int32 word (keeps the activations O(1))


def _engine(layers: int, S_cap: int, T_cap: int, progress, dense: str = "bf16"):
    """A CudaEngine holding `layers` random K2.6 MoE layers (dense weights bf16 bits or float32), activations for
    T_cap rows, a cache of S_cap."""
    from cuda_engine.device import DevBuf, driver
    from cuda_engine.engine import CudaEngine, tile_linear_weights
    from cuda_engine.ops import Ops
    from kdtr_format.bf16 import bf16_bits
    from refmodel.config import PRESETS
    from refmodel.model import yarn_inv_freq

    cfg = dataclasses.replace(PRESETS["k26"], num_hidden_layers=layers, first_k_dense_replace=0)
    D, H, Q, C, N, R, U = (cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank,
                           cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    e = CudaEngine(w4a16="fast")
    e.ops, e.cfg = Ops(), cfg
    rng = np.random.default_rng(0)

    def rand(*shape):
        fan_in = shape[-1]
        w = rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(fan_in))
        return bf16_bits(w) if dense == "bf16" else w

    mats = {"qkv_a": rand(Q + C + R, D), "q_b": rand(H * (N + R), Q), "w_uk": rand(H, N, C), "w_uv": rand(H, U, C),
             "o_proj": rand(D, H * U), "gate": rand(E, D)}
    ones = {"input_ln": D, "post_ln": D, "q_a_ln": Q, "kv_a_ln": C}
    t0 = time.perf_counter()
    e.layers = []
    for l in range(layers):
        w = {k: DevBuf.from_array(v) for k, v in mats.items()}
        tile_linear_weights(e.ops, w, mats)
        w.update({k: DevBuf.from_array(np.ones(n, np.float32)) for k, n in ones.items()})
        w["bias"] = DevBuf.from_array(np.zeros(E, np.float32))
        w["gate_up.mma"] = _expert_stack((E + 1, 2 * I // 32, D // 32, 144), rng)
        w["down.mma"] = _expert_stack((E + 1, D // 32, I // 32, 144), rng)
        e.layers.append(w)
    e.n_int4, e.int4_width = [E + 1] * layers, [I] * layers
    e.norm = DevBuf.from_array(np.ones(D, np.float32))
    e.inv_freq = DevBuf.from_array(yarn_inv_freq(cfg), np.float64)
    e.meta = DevBuf.from_array(np.zeros(4, np.int32))
    e.T_cap = e.S_cap = 0
    e._alloc_activations(T_cap, S_cap)
    e._alloc_cache(S_cap)
    drv = driver()
    for l in range(layers):                   # 2^-7 everywhere: its terms are 2^-7, 0, 0 (K2.6's rows have no padding)
        planes = e.cache["kv"].view(l)
        drv.memset_d16(planes.view(0).ptr, 0x3C00, planes.view(0).nbytes // 2)
        drv.memset_d8(planes.view(1).ptr, 0, 2 * planes.view(1).nbytes)
    e.ops.stream.synchronize()
    mb = _mb(e.layers[0], 'gate_up.mma', 'down.mma')
    progress(f"k26: dense weights {dense}; {layers} layers of 384 + 1 INT4 experts ({E + 1} x {mb} "
             f"MB) on the device in {time.perf_counter() - t0:.1f} s; cache {S_cap} rows, {T_cap} rows per forward")
    return e


def _mb(w, *keys) -> str:
    return f"{sum(w[k].nbytes for k in keys) / w[keys[0]].shape[0] / 1e6:.1f}"


def _expert_stack(shape, rng):
    """[E', Nb, G, 144] int32 on the device: one random expert (scales SCALE_BITS), copied into every slot
    by doubling device-to-device copies."""
    from cuda_engine.device import DevBuf

    one = rng.integers(-2**31, 2**31 - 1, shape[1:], dtype=np.int32)
    one[..., 128:] = np.int32(SCALE_BITS)
    buf = DevBuf(shape, np.int32)
    buf.view(0).set(one)
    per, n = one.nbytes, 1
    while n < shape[0]:
        k = min(n, shape[0] - n)
        DevBuf((k * per // 4,), np.int32, buf.ptr + n * per, buf._owner).copy_from(
            DevBuf((k * per // 4,), np.int32, buf.ptr, buf._owner), k * per)
        n += k
    return buf


def _graph_us(ops, fn, reps: int, note: dict | None = None, edges: str | None = None) -> float:
    """Microseconds per replay of fn's launches as one CUDA graph (CUDA events over `reps` replays; kernel ->
    kernel edges `edges`, by default the engine's: cuda_engine.graph.capture). Where no
    graph can be captured (no cuda-bindings), the launches themselves, timed alike (each launch then costs its
    host overhead too), and note["timing"] says why."""
    from cuda_engine.device import CudaEngineError, timed_us
    from cuda_engine.graph import capture

    fn()                                    # uncaptured: reserves workspaces, surfaces a fault here
    ops.stream.synchronize()
    try:
        g = capture(ops, fn, edges)
        run = lambda: g.launch(ops.stream)  # noqa: E731
    except CudaEngineError as e:
        if note is not None:
            note["timing"] = f"prepared launches, no CUDA graph ({e})"[:300]
        g, run = None, fn
    try:
        for _ in range(2):
            run()
        return timed_us(ops, run, reps)
    finally:
        if g is not None:
            g.destroy()


def _copy_gbps(e, reps: int):
    """GB/s of one stream read over layer 0's gate+up stack (6.4 GB, far past the L2): the copy floor the
    MoE half is set against (as in `kdtr bench w4a16`); None if it failed."""
    from cuda_engine.device import DevBuf

    try:
        w = e.layers[0]["gate_up.mma"]
        sink = DevBuf.from_array(np.zeros(4, np.int32))
        n = w.nbytes // 16 * 16
        return n / _graph_us(e.ops, lambda: e.ops.stream_read(w.ptr, n, sink), max(2, reps // 2)) / 1e3
    except Exception:  # noqa: BLE001 - fail soft: the floor column stays empty
        return None


def _set_layer_inputs(e, l: int, parents, cached: int, held, rng) -> None:
    """Random rows for layer l's input (normed and residual), the positions (cached + depth), the meta's
    cached rows, the tree mask (none for one row) and held expert ids (-1: the router's choice)."""
    from bench.k26_ddtree import _depths

    T, D, K = len(parents), e.cfg.hidden_size, e.cfg.num_experts_per_tok
    x = rng.standard_normal((T, D), dtype=np.float32)
    e.buf["attn_in"].view(l).set(x)
    e.buf["x0"].set(rng.standard_normal((T, D), dtype=np.float32))
    mask = tree_mask(parents, cached) if T > 1 else None
    e._set_inputs(None, cached + _depths(parents), cached, mask)
    rows = np.full((e.T_cap, K), -1, np.int32)
    if held is not None:
        rows[:T] = held
    e.buf["held"].view(l).set(rows)


def measure(shapes: dict, contexts, layers: int = 3, reps: int = 5, share: float = 0.5, time_budget_s: float = 90.0,
            progress=print, checkpoint=None, dense: str = "bf16") -> dict:
    """Per layer, context and routing: the AR step (one row, causal) and the verify of each tree in `shapes`
    ({b: parents [b+1]}), the whole layer and its MoE half; the distinct routed experts the layer's slots
    hold afterwards. Layer 0 first at every context, then the others (a cut run keeps a whole layer).
    checkpoint(result) is called after the setup and after each layer and context with what ran so far
    (complete: False until the end)."""
    from cuda_engine.device import device_info

    from bench.k26_ddtree import DENSE_ITEMSIZE

    if dense not in DENSE_ITEMSIZE:
        raise ValueError(f"dense weights {dense!r}: choose one of {', '.join(DENSE_ITEMSIZE)}")
    t_start = time.perf_counter()
    budgets = sorted(shapes)
    T_cap = 1 << (max(len(p) for p in shapes.values()) - 1).bit_length()
    res = {**device_info(), "layers": layers, "reps": reps, "share": share, "contexts": list(contexts),
           "time_budget_s": time_budget_s, "measurements": [], "skipped": 0, "complete": False,
           "timing": "CUDA graph replays", "dense": dense}
    e = _engine(layers, max(contexts) + T_cap, T_cap, progress, dense)
    res["setup_s"] = time.perf_counter() - t_start
    res["copy_gbps"] = _copy_gbps(e, reps)
    if checkpoint:
        checkpoint(res)
    rng = np.random.default_rng(1)
    K = e.cfg.num_experts_per_tok
    for l in range(layers):
        for cached in contexts:
            cases = [("ar", 0, np.array([-1]))] + [(r, b, shapes[b]) for r in ("router", "correlated") for b in budgets]
            for routing, b, parents in cases:
                m = {"layer": l, "context": cached, "routing": routing, "budget": b, "rows": len(parents),
                     "us_layer": None, "us_moe": None, "us_mla": None, "distinct_routed": None, "error": None}
                res["measurements"].append(m)
                if time.perf_counter() - t_start > time_budget_s:
                    m["error"] = "skipped: past the time budget"
                    res["skipped"] += 1
                    continue
                try:
                    T = len(parents)
                    held = route_tree(parents, share, rng) if routing == "correlated" else None
                    _set_layer_inputs(e, l, parents, cached, held, rng)
                    kv = e.cache["kv"].view(l)
                    m["us_layer"] = _graph_us(e.ops, lambda: e._layer(l, T, e.buf["x0"], kv, T > 1), reps, res)
                    ids = e.buf["slot_ids"].view(l).get((T, K + 1))[:, :K]
                    m["distinct_routed"] = int(np.unique(ids).size)
                    m["us_moe"] = _graph_us(e.ops, lambda: e._mlp_half(l, T), reps, res)
                    m["us_mla"] = _graph_us(e.ops, lambda: e._mla_core(l, T, kv, T > 1), reps, res)
                except Exception as ex:  # noqa: BLE001 - fail soft: record it, measure the rest
                    m["error"] = f"{type(ex).__name__}: {ex}"[:400]
                progress(_line(m))
            res["elapsed_s"] = time.perf_counter() - t_start
            if checkpoint:
                checkpoint(res)
    res["elapsed_s"], res["complete"] = time.perf_counter() - t_start, True
    return res


def _line(m: dict) -> str:
    if m["error"]:
        return f"  L{m['layer']} ctx {m['context']} {m['routing']} b{m['budget']}: {m['error']}"
    return (f"  L{m['layer']} ctx {m['context']} {m['routing']:>10} b{m['budget']:<3} rows {m['rows']:3d}: layer "
            f"{m['us_layer']:8.1f} us, MoE half {m['us_moe']:8.1f} us, MLA core {m['us_mla']:8.1f} us, "
            f"{m['distinct_routed']} routed experts")
