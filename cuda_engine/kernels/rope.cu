// YaRN RoPE on the checkpoint's interleaved pairs (2i, 2i+1), in place:
//   x[2i] <- x[2i] c - x[2i+1] s,  x[2i+1] <- x[2i] s + x[2i+1] c,
//   c = cos(pos * inv_freq[i]) * attn_factor, s = sin(...) * attn_factor.
// Angles in float64: positions reach 2^18, where a float32 product pos * inv_freq is off by ~1e-2 rad;
// cos/sin are taken in double and rounded once to float32, exactly as the oracle casts its float64
// cos/sin. Double math is slow on sm_120 (1/64 rate) but it is R/2 values per token.
// Contract: float32, in place, queries and key in one launch: token t's query head h starts at
// q + t * q_row_stride + h * q_head_stride + q_offset, its (single, shared) rope key at
// k + t * k_row_stride + k_offset (k may be NULL); each holds R values. positions int32 [T] on the device
// (a replayed graph reads the new position), inv_freq float64 [R/2].
// Launch: grid (T), block BLOCK_THREADS; threads stride over (head, pair), the key being head n_heads.
// __fmul_rn/__fsub_rn keep the compiler from fusing into FMAs, so the rounding matches NumPy's.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
rope_kernel(float* __restrict__ q, int q_row_stride, int q_head_stride, int q_offset, int n_heads,
            float* __restrict__ k, int k_row_stride, int k_offset, int R,
            const int* __restrict__ positions, const double* __restrict__ inv_freq, double attn_factor) {
    const int t = blockIdx.x, half = R / 2;
    const int heads = n_heads + (k != nullptr);                // head n_heads = the shared k_pe
    const double pos = (double)positions[t];
    for (int j = threadIdx.x; j < heads * half; j += blockDim.x) {
        const int h = j / half, i = j % half;
        const double angle = pos * inv_freq[i];
        const float c = (float)(cos(angle) * attn_factor), s = (float)(sin(angle) * attn_factor);
        float* p = h < n_heads ? q + (size_t)t * q_row_stride + h * q_head_stride + q_offset + 2 * i
                               : k + (size_t)t * k_row_stride + k_offset + 2 * i;
        const float x0 = p[0], x1 = p[1];
        p[0] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
        p[1] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
    }
}
