// Tensor-core helpers shared by the kernels that use mma.sync (w4a16_mma.cu, attention.cu, linear.cu). Only
// instructions sm_90 and sm_120 both have: mma.sync m16n8k16 bf16 -> f32, ldmatrix, prmt, cp.async.
//
// FP32-faithful products of two float32 operands (attention.cu's GEMMs; linear.cu's bf16 linear splits only its
// activations, its weights being exact in bf16 already): each operand is split exactly into
// three bf16 terms, x = x0 + x1 + x2 (split3: x0 = rn_bf16(x), x1 = rn_bf16(x - x0), x2 = x - x0 - x1; every
// difference is exact in float32 and x2 needs at most 8 significant bits, so it is exact in bf16; the rounding
// is done with integer operations, rn_bf16_bits). A product of
// two bf16 terms is exact in float32, and the tensor cores accumulate in float32. Of the nine term products
// mma_split6 keeps the six down to 2^-16 relative (x0 y0; x0 y1, x1 y0; x0 y2, x1 y1, x2 y0) and drops x1 y2,
// x2 y1, x2 y2 (|x1| <= 2^-8 |x|, |x2| <= 2^-16 |x|), which add at most 2^-23 |x y| (+ 2^-32): one float32 ulp
// of the product (two unit roundoffs), the class of a float32 multiply-add (tests/test_cuda_kernels.py). The leading product
// x0 y0 goes into its own accumulator `hi` and the five small ones into `lo`, so the corrections are never
// rounded against the large running sum (the tensor cores' float32 accumulation truncates); the caller starts
// `hi` afresh every few k steps and folds it into a float32 total with a rounded add.
#pragma once
#include <cuda_bf16.h>

__device__ __forceinline__ void mma_bf16(float* c, const unsigned* a, const unsigned* b) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Four 8x8 b16 matrices from shared memory; lane i gives the address of one 16-byte row (lanes 8 m .. 8 m + 7:
// matrix m). Without .trans lane l receives row l / 4, elements 2 (l % 4), +1 of each matrix; with .trans, the
// same of the transposed matrix.
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_trans(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

// The float32 bits of x rounded to the nearest bf16, ties to even (finite x): the bits cvt.rn.bf16.f32 gives,
// widened, from integer operations at full rate (the conversion instruction runs at a fraction of it).
__device__ __forceinline__ unsigned rn_bf16_bits(float x) {
    const unsigned u = __float_as_uint(x);
    return (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
}

// x = t0 + t1 + t2 exactly, each a bf16 (as float32 bits, low halves zero), for 2^-110 <= |x| < 0x1.ffp127
// (~3.396e38) and for zero. t0 = rn_bf16(x), t1 = rn_bf16(x - t0), t2 = x - t0 - t1: both differences are exact
// in float32 and t2 has at most 8 significant bits. Below 2^-110 a subnormal remainder may lose bits under
// 2^-133 (absolute; the attention's p = exp(score - max) gets there past score gaps of ~76); from 0x1.ffp127
// on t0 rounds to infinity and the terms are inf, -inf, NaN (the kernels' operands are activations, far below).
// Exact only with denormals kept: no -ftz / --use_fast_math (cuda_engine/build.py, NVCC_FLAGS).
__device__ __forceinline__ void split3(float x, unsigned (&t)[3]) {
    t[0] = rn_bf16_bits(x);
    const float r0 = x - __uint_as_float(t[0]);
    t[1] = rn_bf16_bits(r0);
    t[2] = __float_as_uint(r0 - __uint_as_float(t[1])) & 0xFFFF0000u;
}

// The three terms of (a, b) as bf16 pairs, a in the low half of each word: mma operand registers.
__device__ __forceinline__ void split3_pair(float a, float b, unsigned& t0, unsigned& t1, unsigned& t2) {
    unsigned ta[3], tb[3];
    split3(a, ta);
    split3(b, tb);
    t0 = __byte_perm(ta[0], tb[0], 0x7632);
    t1 = __byte_perm(ta[1], tb[1], 0x7632);
    t2 = __byte_perm(ta[2], tb[2], 0x7632);
}

// Eight consecutive float32 as the 16-byte rows of their three bf16 terms (t[term] = 8 bf16, in order).
__device__ __forceinline__ void split3_x8(const float (&v)[8], uint4 (&t)[3]) {
    split3_pair(v[0], v[1], t[0].x, t[1].x, t[2].x);
    split3_pair(v[2], v[3], t[0].y, t[1].y, t[2].y);
    split3_pair(v[4], v[5], t[0].z, t[1].z, t[2].z);
    split3_pair(v[6], v[7], t[0].w, t[1].w, t[2].w);
}

// n (<= 8, at most 0: none) consecutive float32 from p, zeros after them; one pair of 16-byte loads when aligned.
__device__ __forceinline__ void load8(const float* __restrict__ p, int n, float (&v)[8]) {
    if (n >= 8 && (reinterpret_cast<size_t>(p) & 15) == 0) {
        const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        return;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = j < n ? p[j] : 0.0f;
}

// x's three bf16 terms (split3) stored at dst, dst + plane, dst + 2 plane: the latent cache and the attention's
// queries are kept so (kv_layout.cuh), split once where they are written instead of by every block that reads them.
__device__ __forceinline__ void store_terms(unsigned short* dst, size_t plane, float x) {
    unsigned t[3];
    split3(x, t);
    dst[0] = static_cast<unsigned short>(t[0] >> 16);
    dst[plane] = static_cast<unsigned short>(t[1] >> 16);
    dst[2 * plane] = static_cast<unsigned short>(t[2] >> 16);
}

// 16 bytes from global to shared memory without passing through registers (cp.async.cg: cached in L2 only); the
// bytes past src_bytes (0 .. 16) are filled with zeros, so src_bytes = 0 stages a zero row (src must still be a
// valid address). Completion: cp_async_commit closes a group, cp_async_wait<N> waits until at most N groups are
// still in flight (then __syncthreads before other threads read the data).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// One m16n8k16 tile of sum_k a[m, k] b[k, n] from the split operands: a[t] the A fragment of term t, b[t] the
// B fragment (two registers) of term t.
__device__ __forceinline__ void mma_split6(float* hi, float* lo, const unsigned (&a)[3][4], const unsigned* b0,
                                           const unsigned* b1, const unsigned* b2) {
    mma_bf16(lo, a[2], b0);
    mma_bf16(lo, a[1], b1);
    mma_bf16(lo, a[0], b2);
    mma_bf16(lo, a[1], b0);
    mma_bf16(lo, a[0], b1);
    mma_bf16(hi, a[0], b0);
}
