// YaRN RoPE on the checkpoint's interleaved pairs (2i, 2i+1), in place:
//   x[2i] <- x[2i] c - x[2i+1] s,  x[2i+1] <- x[2i] s + x[2i+1] c,
//   c = cos(pos * inv_freq[i]) * attn_factor, s = sin(...) * attn_factor.
// Angles in float64: positions reach 2^18, where a float32 product pos * inv_freq is off by ~1e-2 rad;
// cos/sin are taken in double and rounded once to float32, exactly as the oracle casts its float64
// cos/sin. Double math is slow on sm_120 (1/64 rate) but it is R/2 values per token.
// Contract: x float32; token t's head h starts at x + t * row_stride + h * head_stride + offset and
// holds R values. positions int32 [T] on the device (a replayed graph reads the new position),
// inv_freq float64 [R/2]. Launch: grid (T), block BLOCK_THREADS; threads stride over (head, pair).
// __fmul_rn/__fsub_rn keep the compiler from fusing into FMAs, so the rounding matches NumPy's.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS)
rope_kernel(float* __restrict__ x, int row_stride, int head_stride, int offset, int n_heads, int R,
            const int* __restrict__ positions, const double* __restrict__ inv_freq, double attn_factor) {
    const int t = blockIdx.x, half = R / 2;
    const double pos = (double)positions[t];
    for (int k = threadIdx.x; k < n_heads * half; k += blockDim.x) {
        const int h = k / half, i = k % half;
        const double angle = pos * inv_freq[i];
        const float c = (float)(cos(angle) * attn_factor), s = (float)(sin(angle) * attn_factor);
        float* p = x + (size_t)t * row_stride + h * head_stride + offset + 2 * i;
        const float x0 = p[0], x1 = p[1];
        p[0] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
        p[1] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
    }
}
