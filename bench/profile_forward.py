"""Where a forward's time goes, kernel by kernel, on a GPU: each launch bracketed by two CUDA events, so each
kernel's device time is measured alone (the launches are prepared ones, far apart: nothing overlaps), set
against the same launches replayed as one CUDA graph with the engine's edges. Their difference is what the
graph spends between kernels (launch latency, the ramp of each grid), the part fusion or programmatic edges
can save; the per-kernel times are the part only faster kernels can.

    python bench/profile_forward.py [BUNDLE...] [--k26] [--reps 20] [--json out.json]

- BUNDLE (default the two tiny bundles): the decode step (one token after an 8-token prompt) and a DDTree
  round's verify forward (the tree the engine's own DDTree built, its budget's rows), plus the drafter's block
  forward and the tree builder;
- --k26: one random-weight K2.6 layer at true dims (bench/k26_ddtree_gpu.py): the AR step and a 5-row verify
  over 4096 and 32768 cached rows.

Needs an NVIDIA GPU and PyCUDA (cuda_engine/device.py); without them it says so and exits 6 (engine error).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TINY = ["bundles/model_tiny.kdtr", "bundles/model_int4_tiny.kdtr"]


class _Timed:
    """A kernel whose prepared launches are bracketed by CUDA events (the profiler's proxy in ops.fn)."""

    def __init__(self, fn, name: str, log: list):
        self._fn, self._name, self._log = fn, name, log

    def prepared_async_call(self, grid, block, stream, *args, **kw):
        from cuda_engine.device import driver

        start, end = driver().Event(), driver().Event()
        start.record(stream)
        self._fn.prepared_async_call(grid, block, stream, *args, **kw)
        end.record(stream)
        self._log.append((self._name, start, end))

    def __getattr__(self, attr):
        return getattr(self._fn, attr)


def kernel_times(ops, fn, reps: int) -> dict:
    """{kernel: [launches per call, device us per call]} of fn()'s launches, each timed alone, mean over reps."""
    log: list = []
    saved = dict(ops.fn)
    ops.fn.update({name: _Timed(f, name, log) for name, f in saved.items()})
    try:
        fn()                                                # warm: workspaces reserved, code loaded
        ops.stream.synchronize()
        log.clear()
        for _ in range(reps):
            fn()
        ops.stream.synchronize()
    finally:
        ops.fn.clear()
        ops.fn.update(saved)
    out: dict = {}
    for name, start, end in log:
        n, us = out.get(name, (0, 0.0))
        out[name] = (n + 1, us + end.time_since(start) * 1000.0)
    return {name: [n / reps, us / reps] for name, (n, us) in sorted(out.items(), key=lambda kv: -kv[1][1])}


def graph_us(ops, fn, reps: int) -> float:
    """Microseconds per replay of fn()'s launches captured as one graph (the engine's edges)."""
    from cuda_engine.device import timed_us
    from cuda_engine.graph import capture

    fn()
    ops.stream.synchronize()
    g = capture(ops, fn)
    try:
        for _ in range(3):
            g.launch(ops.stream)
        return timed_us(ops, lambda: g.launch(ops.stream), reps)
    finally:
        g.destroy()


def profile(ops, label: str, fn, reps: int, progress=print) -> dict:
    kernels = kernel_times(ops, fn, reps)
    total = sum(us for _, us in kernels.values())
    graph = graph_us(ops, fn, reps)
    launches = sum(n for n, _ in kernels.values())
    progress(f"{label}: {launches:.0f} launches, kernels alone {total:.1f} us, as a graph {graph:.1f} us "
             f"(between kernels {graph - total:+.1f} us, {(graph - total) / max(launches, 1):+.2f} a launch)")
    for name, (n, us) in kernels.items():
        progress(f"    {name:34s} {n:5.1f} x {us / n:7.2f} us = {us:8.1f} us  {100 * us / total:5.1f}%")
    return {"label": label, "launches": launches, "kernels_us": total, "graph_us": graph, "kernels": kernels}


def bundle_cases(bundle: str, reps: int, progress=print) -> list[dict]:
    import numpy as np

    from cuda_engine.bench_ddtree import _golden_prompts, ddtree_run
    from cuda_engine.engine import CudaEngine
    from kdtr_format import open_kdtr

    e = CudaEngine()
    e.load(bundle)
    ops = e.ops
    out = []
    prompt = np.arange(8) % (e.cfg.vocab_size - 1)
    e._ensure(8, 8 + 4 * reps + 16)
    logits, _ = e.prefill(prompt, np.arange(8))
    first = int(np.argmax(logits[-1]))

    def decode():                      # the engine's decode graph's launches; each call moves the inputs on
        e._launch_forward(1, masked=False, argmax_out=e.buf["ids"])
        ops.decode_advance(e.meta, e.buf["positions"])

    e._set_inputs([first], [8], 8, None)

    out.append(profile(ops, f"{bundle}: decode step", decode, reps, progress))
    with open_kdtr(bundle) as f:
        prompt, pos0 = _golden_prompts(f)[0]
    st = e._ddtree_state()
    ddtree_run(e, prompt, pos0, 32, builder="device")         # leaves a built tree and its state in place
    dr = st.drafter
    saved = dr.inp.get()
    out.append(profile(ops, f"{bundle}: verify forward ({st.T} rows)", st._launch_verify_dev, reps, progress))
    if dr is not None:
        dr.inp.set(saved)
        out.append(profile(ops, f"{bundle}: drafter block", dr._launch_block, reps, progress))
        dr.inp.set(saved)
        out.append(profile(ops, f"{bundle}: tree builder", st._launch_build, reps, progress))
    return out


def k26_cases(reps: int, progress=print) -> list[dict]:
    import numpy as np

    from bench.k26_ddtree_gpu import _engine, _set_layer_inputs

    contexts, T_cap = (4096, 32768), 8
    e = _engine(1, max(contexts) + T_cap, T_cap, progress)
    rng = np.random.default_rng(1)
    out = []
    for cached in contexts:
        for parents in (np.array([-1]), np.array([-1, 0, 1, 2, 0])):
            T = len(parents)
            _set_layer_inputs(e, 0, parents, cached, None, rng)
            kv = e.cache["kv"].view(0)
            label = f"K2.6 layer, {cached} cached rows, {T} row{'s' if T > 1 else ''}"
            out.append(profile(e.ops, label, lambda: e._layer(0, T, e.buf["x0"], kv, T > 1), reps, progress))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundles", nargs="*", metavar="BUNDLE", help="bundles to profile (default: the tiny two)")
    ap.add_argument("--k26", action="store_true", help="also one random-weight K2.6 layer at true dims")
    ap.add_argument("--reps", type=int, default=20, help="calls per measurement (default 20)")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON (written whole, then renamed)")
    a = ap.parse_args(argv)
    if a.reps < 1:
        ap.error(f"--reps {a.reps}: give at least 1")
    bundles = a.bundles or TINY
    for b in bundles:
        if not os.path.isfile(b):
            ap.error(f"{b}: no such bundle (the committed ones are in bundles/)")
    from cuda_engine.device import CudaEngineError, device_info

    try:
        res = {**device_info(), "cases": []}
        for b in bundles:
            res["cases"] += bundle_cases(b, a.reps)
        if a.k26:
            res["cases"] += k26_cases(a.reps)
    except CudaEngineError as e:
        print(f"profile_forward: {e}", file=sys.stderr)
        return 6
    if a.json:
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1)
        os.replace(tmp, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
