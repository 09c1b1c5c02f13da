"""Where a forward's time goes, kernel by kernel, on a GPU. Each launch of one call is recorded (kernel, grid,
arguments) and then replayed alone: a CUDA graph of COPIES back-to-back copies of it (plain edges), so its device
time is measured without the host's launch cost between two kernels; the sum over the launches is set against
the same call's launches replayed as one graph with the engine's edges. Their difference is what the graph
spends between kernels (launch latency, the ramp of each grid), the part fusion or programmatic edges can save;
the per-kernel times are the part only faster or fewer kernels can. (A replayed launch repeats the recorded one
with the same arguments: kernels that move state on, like decode_advance_kernel, are timed over moved state.
And a launch replayed alone finds in L2 what its copy before it read: a weight that fits there, like K2.6's
router gate of 5.5 MB, is read from L2 after the first copy, so such a launch's time alone is short of its time
in the forward, and the difference counts it "between kernels".)

    python bench/profile_forward.py [BUNDLE...] [--k26] [--reps 20] [--launches] [--json out.json]

- BUNDLE (default the two tiny bundles): the decode step (one token after an 8-token prompt) and a DDTree
  round's verify forward (the tree the engine's own DDTree built, its budget's rows), plus the drafter's block
  forward and the tree builder where the bundle has a drafter and the device builds its trees;
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

from kdtr_format.paths import write_atomically  # noqa: E402 - after the path line, as a script

TINY = [os.path.join(ROOT, "bundles", b) for b in ("model_tiny.kdtr", "model_int4_tiny.kdtr")]


COPIES = 10                 # back-to-back copies of one launch per replayed graph


class _Recorded:
    """A kernel whose prepared launches are recorded (and made) while the profiler watches (its proxy in ops.fn)."""

    def __init__(self, fn, name: str, log: list):
        self._fn, self._name, self._log = fn, name, log

    def prepared_async_call(self, grid, block, stream, *args, **kw):
        self._fn.prepared_async_call(grid, block, stream, *args, **kw)
        self._log.append((self._name, self._fn, grid, block, args, kw))

    def __getattr__(self, attr):
        return getattr(self._fn, attr)


def record_launches(ops, fn) -> list:
    """The launches one call of fn() makes: (kernel, function, grid, block, args, keywords), in order."""
    log: list = []
    saved = dict(ops.fn)
    ops.fn.update({name: _Recorded(f, name, log) for name, f in saved.items()})
    try:
        fn()
        ops.stream.synchronize()
    finally:
        for name in list(ops.fn):               # keep a kernel first fetched meanwhile, unwrapped
            f = ops.fn[name]
            ops.fn[name] = f._fn if isinstance(f, _Recorded) else f
    return log


def kernel_times(ops, fn, reps: int, note: dict, each: list | None = None) -> dict:
    """{kernel: [launches per call, device us per call]} of fn()'s launches, each replayed alone (COPIES
    back-to-back copies in a graph with plain edges, `reps` replays); `each`, where given, gets one
    [kernel, grid, us] per launch, in launch order."""
    from bench.k26_ddtree_gpu import _graph_us

    fn()                                          # warm: workspaces reserved, code loaded
    ops.stream.synchronize()
    out: dict = {}
    for name, f, grid, block, args, kw in record_launches(ops, fn):
        def copies(f=f, grid=grid, block=block, args=args, kw=kw):
            for _ in range(COPIES):
                f.prepared_async_call(grid, block, ops.stream, *args, **kw)

        us = _graph_us(ops, copies, reps, note, edges="plain") / COPIES
        n, tot = out.get(name, (0, 0.0))
        out[name] = (n + 1, tot + us)
        if each is not None:
            each.append([name, list(grid), us])
    return {name: [n, us] for name, (n, us) in sorted(out.items(), key=lambda kv: -kv[1][1])}


def profile(ops, label: str, fn, reps: int, progress=print, reset=None) -> dict:
    """reset(), where given, puts fn's inputs back before each of the two measurements (a decode step moves
    them on; its advance kernel replayed alone moves them COPIES x reps steps)."""
    from bench.k26_ddtree_gpu import _graph_us

    note: dict = {}                               # says so if no graph could be captured (timings then host-bound)
    if reset:
        reset()
    each: list = []
    kernels = kernel_times(ops, fn, reps, note, each)
    if reset:
        reset()
    total = sum(us for _, us in kernels.values())
    graph = _graph_us(ops, fn, reps, note)
    launches = sum(n for n, _ in kernels.values())
    progress(f"{label}: {launches:.0f} launches, each alone {total:.1f} us, as one graph {graph:.1f} us "
             f"(between kernels {graph - total:+.1f} us, {(graph - total) / max(launches, 1):+.2f} a launch)")
    for name, (n, us) in kernels.items():
        progress(f"    {name:34s} {n:5.1f} x {us / n:7.2f} us = {us:8.1f} us  {100 * us / total:5.1f}%")
    if note:
        progress(f"    ({note['timing']})")
    return {"label": label, "launches": launches, "kernels_us": total, "graph_us": graph, "kernels": kernels,
            "each": each, **note}


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

    out.append(profile(ops, f"{bundle}: decode step", decode, reps, progress,
                       reset=lambda: e._set_inputs([first], [8], 8, None)))
    with open_kdtr(bundle) as f:
        prompt, pos0 = _golden_prompts(f)[0]
    st = e._ddtree_state()
    dr = st.drafter
    if dr is None or not st.device_builder:
        progress(f"{bundle}: no drafter on the device, or the host builds its trees: no verify, drafter or builder")
        return out
    ddtree_run(e, prompt, pos0, 32, builder="device")         # leaves a built tree and its state in place
    saved = dr.inp.get()
    out.append(profile(ops, f"{bundle}: verify forward ({st.T} rows)", st._launch_verify_dev, reps, progress))
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


def _shown(cases: list[dict], launches: bool) -> list[dict]:
    """cases, after printing each one's launches in order when --launches asked for them."""
    for c in cases if launches else ():
        print(f"{c['label']}: each launch in order (kernel, grid, us):")
        for name, grid, us in c["each"]:
            print(f"      {name:34s} {str(tuple(grid)):16s} {us:8.2f}")
    return cases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundles", nargs="*", metavar="BUNDLE", help="bundles to profile (default: the tiny two)")
    ap.add_argument("--k26", action="store_true", help="also one random-weight K2.6 layer at true dims")
    ap.add_argument("--k26-only", action="store_true", help="only the K2.6 layer: no bundle is read (for a tree "
                    "that holds none)")
    ap.add_argument("--reps", type=int, default=20, help="calls per measurement (default 20)")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON (written whole, then renamed); it "
                    "holds every launch's time too")
    ap.add_argument("--launches", action="store_true", help="also print every launch (kernel, grid, us) in order")
    a = ap.parse_args(argv)
    if a.reps < 1:
        ap.error(f"--reps {a.reps}: give at least 1")
    if a.k26_only and a.bundles:
        ap.error(f"--k26-only profiles no bundle, but {' '.join(a.bundles)} was named: drop one or the other")
    bundles = [] if a.k26_only else a.bundles or TINY
    for b in bundles:
        if not os.path.isfile(b):
            ap.error(f"{b}: no such bundle (the committed ones are in bundles/; --k26-only profiles the K2.6 layer "
                     f"without any)")
    from cuda_engine.device import CudaEngineError, device_info

    res: dict = {"cases": []}
    try:
        res.update(device_info())
        for b in bundles:
            res["cases"] += _shown(bundle_cases(b, a.reps), a.launches)
        if a.k26 or a.k26_only:
            res["cases"] += _shown(k26_cases(a.reps), a.launches)
    except CudaEngineError as e:
        print(f"profile_forward: {e}", file=sys.stderr)
        res["error"] = str(e)
        return 6
    finally:
        if a.json and (res["cases"] or "error" not in res):       # what ran is kept, also after a failure
            write_atomically(a.json, lambda fh: fh.write(json.dumps(res, indent=1).encode()), stream_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
