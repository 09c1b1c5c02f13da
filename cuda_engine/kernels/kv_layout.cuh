// The target's latent cache as the attention GEMMs read it (kv_cache.cu writes and compacts it, ddtree.cu
// compacts it inside a captured round, attention.cu reads it; docs/cuda-engine.md, "The latent cache").
//
// Per layer: three planes [3][kv_rows][Kp] of bf16 bits, plane t holding term t of split3 (tensor_core.cuh) of
// every cached value, so t0 + t1 + t2 is the float32 value exactly. A row is [c_kv (C) | k_pe (R) | zeros]:
// Kp = K rounded up to a multiple of 8 (K = C + R), so every row starts on a 16-byte boundary and a row's columns
// go in whole 16-byte pieces (cp.async); the padding is zero, and a zero column adds exactly 0 to a dot product.
// The layer's planes start at kv + l * 3 * kv_rows * Kp.
//
// Why terms and not float32: the GEMMs multiply on the tensor cores in bf16 terms. Split where a row is written
// (once), a value costs its GEMMs no rounding work at all; split where it is read, every block that loads it
// splits it again (the cache of 32768 rows was split 5 times per 5-row verify, once per 64 query rows). The cost
// is 6 bytes a value instead of 4.
#pragma once

#define KV_PIECE 8                         // bf16 per 16-byte piece: Kp is a multiple of it

__host__ __device__ __forceinline__ int kv_pitch(int C, int R) { return (C + R + KV_PIECE - 1) / KV_PIECE * KV_PIECE; }

// Rows start + keep[i] -> start + i (i = 0 .. n-1) of one layer's three planes, in order: keep is strictly
// increasing (an accepted DDTree path), so keep[i] >= i and each row is read before a later row overwrites it.
// A thread copies the same 16-byte pieces of every row, so only the barrier between rows orders the block.
__device__ __forceinline__ void kv_move_rows(unsigned short* layer, const int* __restrict__ keep, int n, int start,
                                             int kv_rows, int Kp) {
    const size_t plane = (size_t)kv_rows * Kp;
    const int pieces = Kp / KV_PIECE;
    for (int i = 0; i < n; ++i) {
        const size_t src = ((size_t)start + keep[i]) * Kp, dst = ((size_t)start + i) * Kp;
        for (int j = threadIdx.x; j < 3 * pieces; j += blockDim.x) {
            const size_t off = (j / pieces) * plane + (size_t)(j % pieces) * KV_PIECE;
            *reinterpret_cast<uint4*>(layer + off + dst) = *reinterpret_cast<const uint4*>(layer + off + src);
        }
        __syncthreads();
    }
}
