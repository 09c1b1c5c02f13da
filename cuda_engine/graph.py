"""CUDA graph capture of a launch sequence on the engine's PyCUDA stream, through NVIDIA's cuda-bindings.

PyCUDA has no graph API; the driver's stream capture works on PyCUDA's own stream handle, and replaying
the instantiated graph costs ~1 us per kernel instead of ~7 us for a prepared PyCUDA launch (measured on
the H200, docs/cuda-engine.md). A captured sequence bakes in its kernel arguments (pointers and sizes),
so the engine captures only the shape-stable decode step and re-captures after any reallocation.
"""
from __future__ import annotations

import gc

from cuda_engine.device import CudaEngineError


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

    def __init__(self, graph, exe, launches: int):
        self._graph, self._exe, self.launches = graph, exe, launches

    def launch(self, stream) -> None:
        _check(_cu().cuGraphLaunch(self._exe, stream.handle), "cuGraphLaunch")

    def destroy(self) -> None:
        cu = _cu()
        if self._exe is not None:
            cu.cuGraphExecDestroy(self._exe)
            cu.cuGraphDestroy(self._graph)
            self._exe = self._graph = None


def capture(ops, record) -> Graph:
    """Run `record()` (which launches on ops.stream) under stream capture; returns the instantiated graph."""
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
    exe = _check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
    return Graph(graph, exe, ops.launches - before)
