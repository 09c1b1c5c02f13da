"""The CUDA engine: hand-written kernels for sm_90 / sm_120 behind the conformance protocol, driven through
PyCUDA (docs/cuda-engine.md). Imported only where a GPU run is asked for: CPU code never imports pycuda."""
