// YaRN RoPE on one interleaved pair (2i, 2i+1), shared by the kernels that rotate (attention.cu: q_pe,
// kv_cache.cu: k_pe):  x[2i] <- x[2i] c - x[2i+1] s,  x[2i+1] <- x[2i] s + x[2i+1] c,
//   c = cos(pos * inv_freq[i]) * attn_factor,  s = sin(...) * attn_factor.
// Angles in float64: positions reach 2^18, where a float32 product pos * inv_freq is off by ~1e-2 rad;
// cos/sin are taken in double and rounded once to float32, exactly as the oracle casts its float64
// cos/sin (double math is slow on sm_120, 1/64 rate, but it is R/2 values per token and head).
// __fmul_rn/__fsub_rn keep the compiler from fusing into FMAs, so the rounding matches NumPy's.
#pragma once

__device__ __forceinline__ void rope_pair(float x0, float x1, double pos, double inv_freq, double attn_factor,
                                          float* y0, float* y1) {
    const double angle = pos * inv_freq;
    const float c = (float)(cos(angle) * attn_factor), s = (float)(sin(angle) * attn_factor);
    *y0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    *y1 = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
}
