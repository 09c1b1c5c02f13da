"""Decode latency of the CUDA engine on a bundle's model: one token per step, greedy (AR), the step run
as prepared PyCUDA launches and as a replayed CUDA graph (with the engine's kernel -> kernel edges,
cuda_engine.graph.GRAPH_EDGES, and the same step captured with plain edges), against the launch floor measured in the
same run (the same number of launches of a one-thread kernel, prepared and as a graph both ways).

Used by `kdtr bench engine` and bench/bench_engine.py. Times are CUDA-event times over `steps`
back-to-back steps after `warmup` steps; the graph steps need no host work at all (the argmax feeds the
next step's token on the device), the prepared steps pay Python's launch cost per kernel.
"""
from __future__ import annotations

import numpy as np

from cuda_engine.device import DevBuf, device_info, driver
from cuda_engine.device import timed_us as _timed
from cuda_engine.engine import CudaEngine


def decode_latency(bundle: str, steps: int = 200, warmup: int = 20, prompt_len: int = 16,
                   w4a16: str = "fast") -> dict:
    e = CudaEngine(w4a16=w4a16)
    e.load(bundle)
    ops, V = e.ops, e.cfg.vocab_size
    prompt = np.random.default_rng(0).integers(0, V - 1, prompt_len)
    e._ensure(prompt_len, prompt_len + 2 * (steps + warmup) + 2)       # no reallocation while timing
    logits, _ = e.prefill(prompt, np.arange(prompt_len))
    first = int(np.argmax(logits[-1]))

    def restart():                                                      # the step after the prompt
        e._set_inputs([first], [prompt_len], prompt_len, None)

    def prepared():
        e._launch_forward(1, masked=False, argmax_out=e.buf["ids"])
        ops.decode_advance(e.meta, e.buf["positions"])

    restart()
    n0 = ops.launches
    _timed(ops, prepared, warmup)
    per_step = (ops.launches - n0) // warmup
    restart()
    t_prepared = _timed(ops, prepared, steps)
    restart()
    tokens_prepared = _generated(e, prepared, 8)
    graph = e._decode_graph()
    plain = _capture(ops, prepared, "plain")              # the same step with plain edges: the A/B
    # ABBA: the engine's edges, plain, plain, the engine's; each time the mean of its two runs (a drift in the
    # clocks over the run falls on both alike)
    runs = [_graph_steps(e, restart, g, warmup, steps) for g in (graph, plain, plain, graph)]
    t_graph, t_plain = (runs[0][0] + runs[3][0]) / 2, (runs[1][0] + runs[2][0]) / 2
    tokens_graph, tokens_plain = runs[0][1], runs[1][1]
    same_runs = runs[0][1] == runs[3][1] and runs[1][1] == runs[2][1]
    plain.destroy()

    floor_prep, floor_graph = _launch_floor(ops, per_step, steps)
    _, floor_plain = _launch_floor(ops, per_step, steps, "plain")
    return {**device_info(), "bundle": str(bundle), "w4a16": w4a16, "steps": steps, "launches_per_step": per_step,
            "graph_launches": graph.launches, "graph_edges": graph_edges() if graph.programmatic else "plain",
            "graph_programmatic_edges": graph.programmatic,
            "us_per_token_prepared": t_prepared, "us_per_token_graph": t_graph,
            "us_per_token_graph_plain_edges": t_plain, "plain_edges_vs_graph": t_plain / t_graph,
            "floor_us_per_step_prepared": floor_prep, "floor_us_per_step_graph": floor_graph,
            "floor_us_per_step_graph_plain_edges": floor_plain,
            "graph_vs_floor": t_graph / floor_graph, "prepared_vs_graph": t_prepared / t_graph,
            "same_tokens_graph_and_prepared": tokens_prepared == tokens_graph == tokens_plain and same_runs,
            "tokens": tokens_graph}


def _graph_steps(e: CudaEngine, restart, g, warmup: int, steps: int) -> tuple[float, list[int]]:
    """(us per step, the first 8 tokens) of the decode graph g replayed: warmup steps, then `steps` timed, each
    from the step after the prompt."""
    ops = e.ops
    restart()
    _timed(ops, lambda: g.launch(ops.stream), warmup)
    restart()
    t = _timed(ops, lambda: g.launch(ops.stream), steps)
    restart()
    return t, _generated(e, lambda: g.launch(ops.stream), 8)


def _generated(e: CudaEngine, step, n: int) -> list[int]:
    """The n greedy tokens the step function generates from the current inputs (ids[0] after each step)."""
    out = []
    for _ in range(n):
        step()
        e.ops.stream.synchronize()
        out.append(int(e.buf["ids"].get((1,))[0]))
    return out


def graph_edges() -> str:
    """The kernel -> kernel edges the engine asks for (cuda_engine.graph.GRAPH_EDGES); on a GPU below sm_90 its
    graphs keep plain edges whatever this says (decode_latency reports what the graph has)."""
    import cuda_engine.graph as graph_mod

    return graph_mod.GRAPH_EDGES


def _capture(ops, record, edges: str | None = None):
    """cuda_engine.graph.capture with the engine's kernel -> kernel edges, or the ones named ("late", "early",
    "plain")."""
    from cuda_engine.graph import capture

    return capture(ops, record, edges)


def _launch_floor(ops, n_kernels: int, steps: int, edges: str | None = None) -> tuple[float, float]:
    """(prepared, graph) microseconds for n_kernels launches of the one-thread decode_advance_kernel."""
    scratch = DevBuf.from_array(np.zeros(4, np.int32))

    def seq():
        for _ in range(n_kernels):
            ops.decode_advance(scratch, scratch)

    prepared = _timed(ops, seq, max(steps // 4, 10))
    g = _capture(ops, seq, edges)
    _timed(ops, lambda: g.launch(ops.stream), 10)
    graph = _timed(ops, lambda: g.launch(ops.stream), steps)
    g.destroy()
    return prepared, graph
