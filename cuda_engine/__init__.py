"""PyCUDA engine with hand-written kernels for sm_120 / sm_90 (not written yet)."""
