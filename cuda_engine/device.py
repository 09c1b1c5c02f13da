"""The CUDA device for the engine: one context per process, device buffers, and clear errors.

Everything that touches pycuda lives in cuda_engine (CPU tests never import it). `DevBuf` is a typed
view of device memory (pointer, shape, dtype) with synchronous host copies: the engine copies taps
back only for the runner, so plain copies are simple and enough.
"""
from __future__ import annotations

import math
import os

import numpy as np


class CudaEngineError(RuntimeError):
    """The CUDA engine cannot run: no pycuda, no GPU, an unsupported config, or device memory exhausted."""


_STATE: dict = {}


def driver():
    """pycuda.driver with the device's primary context current (once per process)."""
    if "drv" in _STATE:
        return _STATE["drv"]
    try:
        import pycuda.driver as drv
    except ImportError as e:
        raise CudaEngineError(f"pycuda is not installed ({e}); install it with pip install -e '.[cuda]'") from None
    try:
        drv.init()
        n = drv.Device.count()
    except drv.Error as e:
        raise CudaEngineError(f"the CUDA driver is unavailable: {e}") from None
    if n == 0:
        raise CudaEngineError("no CUDA device found")
    index = int(os.environ.get("KDTR_CUDA_DEVICE", "0"))
    if not 0 <= index < n:
        raise CudaEngineError(f"KDTR_CUDA_DEVICE={index} but only {n} CUDA device(s) exist")
    dev = drv.Device(index)
    ctx = dev.retain_primary_context()
    ctx.push()
    import atexit

    atexit.register(ctx.pop)
    _STATE.update(drv=drv, dev=dev, ctx=ctx)
    return drv


def timed_us(ops, fn, n: int) -> float:
    """Microseconds per call of fn() over n calls on ops.stream (CUDA events): the benches' timer, and the
    cost-aware DDTree's measured price (cuda_engine/ddtree.py)."""
    drv = driver()
    start, end = drv.Event(), drv.Event()
    start.record(ops.stream)
    for _ in range(n):
        fn()
    end.record(ops.stream)
    end.synchronize()
    return end.time_since(start) * 1000.0 / n


def driver_device():
    """The pycuda Device in use."""
    driver()
    return _STATE["dev"]


def device_info() -> dict:
    """Name, compute capability, driver (kernel module and CUDA API versions) and memory of the device in use."""
    drv = driver()
    dev = _STATE["dev"]
    v = drv.get_driver_version()
    return {"device": dev.name(), "compute_capability": "%d.%d" % dev.compute_capability(),
            "driver": _kernel_module_version(), "cuda_driver_api": f"{v // 1000}.{(v % 1000) // 10}",
            "total_memory_bytes": int(dev.total_memory())}


def _kernel_module_version() -> str:
    """The NVIDIA kernel module's version (e.g. 580.159.04) from /proc, else 'unknown'."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            words = f.readline().split()
    except OSError:
        return "unknown"
    return next((w for w in words if w.count(".") >= 1 and w.replace(".", "").isdigit()), "unknown")


class DevBuf:
    """A float32/int32/float64 array in device memory: ptr, shape, dtype; views share the allocation."""

    def __init__(self, shape, dtype, ptr: int | None = None, owner=None, base: "DevBuf | None" = None):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
        self.owns = ptr is None                 # False for a view into another allocation (view(), a given ptr)
        if ptr is None:
            drv = driver()
            try:
                owner = drv.mem_alloc(max(self.nbytes, 1))
            except drv.MemoryError:
                free, total = drv.mem_get_info()
                raise CudaEngineError(f"out of device memory: {self.nbytes / 2**20:.1f} MiB requested for "
                                      f"{self.shape} {self.dtype}, {free / 2**20:.1f} of {total / 2**20:.1f} MiB "
                                      f"free") from None
            ptr = int(owner)
        self.ptr, self._owner = ptr, owner
        self._base = base                    # view(): the buffer it is a view of (its root), whose tiled copy a write
        #                                      through the view rewrites
        self.tiled: "DevBuf | None" = None   # bf16 weights: the copy the mma linear kernels read (ops.Ops.tiled);
        #                                      a write through set() or copy_from(), on the buffer or a view of it,
        #                                      rewrites it in place (same allocation: a captured graph keeps reading
        #                                      it), so it never holds other values than the buffer

    @classmethod
    def from_array(cls, a: np.ndarray, dtype=None) -> "DevBuf":
        a = np.ascontiguousarray(a, dtype=dtype)
        buf = cls(a.shape, a.dtype)
        buf.set(a)
        return buf

    def view(self, index: int) -> "DevBuf":
        """Sub-array `index` along the first axis ([L, T, W] -> [T, W])."""
        if not 0 <= index < self.shape[0]:
            raise IndexError(f"DevBuf.view({index}) outside [0, {self.shape[0]})")
        inner = self.shape[1:]
        return DevBuf(inner, self.dtype, self.ptr + index * math.prod(inner) * self.dtype.itemsize, self._owner,
                      base=self._base or self)

    def set(self, a: np.ndarray) -> None:
        a = np.ascontiguousarray(a, dtype=self.dtype)
        if a.nbytes > self.nbytes:
            raise ValueError(f"DevBuf.set: {a.shape} does not fit {self.shape}")
        if a.nbytes:
            driver().memcpy_htod(self.ptr, a)
        self._retile()

    def get(self, shape=None) -> np.ndarray:
        """The first prod(shape) elements as a host array (the whole buffer by default)."""
        out = np.empty(self.shape if shape is None else shape, self.dtype)
        if out.nbytes > self.nbytes:
            raise ValueError(f"DevBuf.get: {out.shape} is larger than {self.shape}")
        if out.nbytes:
            driver().memcpy_dtoh(out, self.ptr)
        return out

    def copy_from(self, src: "DevBuf", nbytes: int | None = None) -> None:
        n = min(self.nbytes, src.nbytes) if nbytes is None else nbytes
        if n:
            driver().memcpy_dtod(self.ptr, src.ptr, n)
        self._retile()

    def _retile(self) -> None:
        """After a write: the tiled copy of the buffer written (or of the one it is a view of) made again from its
        new values, in place. (A DevBuf made on a raw pointer into a weight is not known to be one: the engine
        never writes weights so.)"""
        root = self._base or self
        if root.tiled is not None:
            from .ops import tile_bf16        # ops imports this module
            root.tiled.set(tile_bf16(root.get()))
