"""CUDA graph capture of a launch sequence on the engine's PyCUDA stream, through NVIDIA's cuda-bindings.

PyCUDA has no graph API; the driver's stream capture works on PyCUDA's own stream handle, and replaying
the instantiated graph costs ~1 us per kernel instead of ~7 us for a prepared PyCUDA launch (measured on
the H200, docs/cuda-engine.md). A captured sequence bakes in its kernel arguments (pointers and sizes),
so the engine captures only the shape-stable decode step and re-captures after any reallocation.

Programmatic edges: after capture, each edge from one kernel node to another may be made programmatic
(CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC), so the second kernel's blocks are scheduled before the first kernel has
ended. Every kernel begins with AFTER_PREVIOUS_GRID() (kernels/common.cuh; `kdtr kernels check` holds it), which
waits for the kernel before it to complete with its writes visible: no result changes, only the gap between two
kernels. A capture's `edges` (by default GRAPH_EDGES, read at each capture) say when the second kernel may be
scheduled:
- "late": once every block of the first has exited (CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC; no kernel triggers
  earlier): the launch overlaps the first kernel's completion and memory flush;
- "early": once every block of the first has begun (CU_GRAPH_KERNEL_NODE_PORT_LAUNCH_ORDER): its blocks then wait,
  resident, beside the first kernel's;
- "plain": ordinary edges (the first kernel ends, then the second is launched).
The environment variable KDTR_GRAPH_EDGES sets it for a process (a measurement); the engine's default is "late".
Measured in docs/cuda-engine.md, "Stop 43".
"""
from __future__ import annotations

import gc
import os

from cuda_engine.device import CudaEngineError

EDGE_MODES = ("late", "early", "plain")
GRAPH_EDGES = os.environ.get("KDTR_GRAPH_EDGES", "late")      # the A/B of docs/cuda-engine.md, "Stop 43"


def _cu():
    try:
        import cuda.bindings.driver as cu
    except ImportError as e:
        raise CudaEngineError(f"CUDA graphs need NVIDIA's cuda-bindings (pip install cuda-bindings): {e}") from None
    return cu


def _check(result, what: str):
    cu = _cu()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CudaEngineError(f"{what} failed: {err}")
    return rest[0] if len(rest) == 1 else rest


class Graph:
    """An instantiated graph; launch() replays it on a stream."""

    def __init__(self, graph, exe, launches: int, programmatic: int = 0):
        self._graph, self._exe, self.launches = graph, exe, launches
        self.programmatic = programmatic          # how many of its kernel -> kernel edges are programmatic

    def launch(self, stream) -> None:
        _check(_cu().cuGraphLaunch(self._exe, stream.handle), "cuGraphLaunch")

    def destroy(self) -> None:
        cu = _cu()
        if self._exe is not None:
            cu.cuGraphExecDestroy(self._exe)
            cu.cuGraphDestroy(self._graph)
            self._exe = self._graph = None


def capture(ops, record, edges: str | None = None) -> Graph:
    """Run `record()` (which launches on ops.stream) under stream capture; returns the instantiated graph, its
    kernel -> kernel edges `edges` (one of EDGE_MODES; by default the engine's, GRAPH_EDGES)."""
    source = "KDTR_GRAPH_EDGES" if edges is None else "edges="
    edges = GRAPH_EDGES if edges is None else edges
    if edges not in EDGE_MODES:
        raise CudaEngineError(f"graph edges {edges!r} ({source}): choose one of {', '.join(EDGE_MODES)}")
    cu = _cu()
    before = ops.launches
    ops.stream.synchronize()
    # No device memory may be freed while a stream captures (cuMemFree then invalidates the capture, and
    # PyCUDA only warns). Python's cycle collector frees the buffers of a dropped engine whenever it runs,
    # so garbage is collected first and the collector is paused until the capture ends.
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        _check(cu.cuStreamBeginCapture(ops.stream.handle, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL),
               "cuStreamBeginCapture")
        ops.capturing = True
        try:
            record()
        finally:
            ops.capturing = False
            graph = _check(cu.cuStreamEndCapture(ops.stream.handle), "cuStreamEndCapture")
    finally:
        if collecting:
            gc.enable()
    try:
        # below sm_90 AFTER_PREVIOUS_GRID() compiles to nothing, so such a device keeps plain edges
        programmatic = make_programmatic(graph, edges) if edges != "plain" and ops.cc_major >= 9 else 0
        exe = _check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
    except BaseException:
        cu.cuGraphDestroy(graph)
        raise
    return Graph(graph, exe, ops.launches - before, programmatic)


def _edge_calls(cu):
    """(get edges, remove, add) with edge data: cuda-bindings 12 names them _v2, 13 without the suffix."""
    if hasattr(cu, "cuGraphGetEdges_v2"):
        return cu.cuGraphGetEdges_v2, cu.cuGraphRemoveDependencies_v2, cu.cuGraphAddDependencies_v2
    return cu.cuGraphGetEdges, cu.cuGraphRemoveDependencies, cu.cuGraphAddDependencies


def make_programmatic(graph, when: str = "late") -> int:
    """Make every plain kernel -> kernel edge of an uninstantiated graph programmatic, "late" or "early" (see
    above); returns how many. Edges to or from other nodes (copies, memsets) stay as they are."""
    if when not in ("late", "early"):
        raise ValueError(f"programmatic edges {when!r}: choose 'late' or 'early' (or capture with plain edges)")
    cu = _cu()
    get, remove, add = _edge_calls(cu)
    n = _check(get(graph, 0), "cuGraphGetEdges")[-1]
    if not n:
        return 0
    frm, to, data, n = _check(get(graph, n), "cuGraphGetEdges")
    kernel = cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL

    def is_kernel(node) -> bool:
        return _check(cu.cuGraphNodeGetType(node), "cuGraphNodeGetType") == kernel

    picked = [i for i in range(n) if int(data[i].type) == 0 and int(data[i].from_port) == 0
              and int(data[i].to_port) == 0 and is_kernel(frm[i]) and is_kernel(to[i])]
    if not picked:
        return 0
    src, dst = [frm[i] for i in picked], [to[i] for i in picked]
    _check(remove(graph, src, dst, [data[i] for i in picked], len(picked)), "cuGraphRemoveDependencies")
    edge = cu.CUgraphEdgeData()
    edge.type = cu.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
    edge.from_port = (cu.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC if when == "late"
                      else cu.CU_GRAPH_KERNEL_NODE_PORT_LAUNCH_ORDER)
    _check(add(graph, src, dst, [edge] * len(picked), len(picked)), "cuGraphAddDependencies")
    return len(picked)
