// Shared helpers for every kdtr kernel (included by each .cu file).
//
// WARPS_PER_BLOCK: the warp-per-output kernels (linear, experts) run 8 warps = 256 threads per block:
// enough warps to hide global-load latency, few enough that a block never needs more than 256 * 255
// registers, well inside sm_120's 64 K registers and 1536 threads per SM.
// Reductions use a fixed butterfly (__shfl_xor_sync) and fixed shared-memory trees: the summation
// order depends only on the launch shape, never on timing, so every run gives the same bits.
#pragma once

#define WARP_SIZE 32
#define WARPS_PER_BLOCK 8
#define BLOCK_THREADS (WARP_SIZE * WARPS_PER_BLOCK)
// __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM): with the thread count alone, ptxas for sm_90 aims
// at 8 resident blocks, caps registers at 32 and spills (kdtr kernels check caught it); asking for
// one block per SM lets it use what it needs (<= 64 here, still 4 blocks of 256 threads per SM).
#define MIN_BLOCKS_PER_SM 1

// Every kernel's first statement (`kdtr kernels check` holds it): programmatic dependent launch. The engine's CUDA
// graphs may make each kernel-to-kernel edge programmatic (cuda_engine/graph.py), so a kernel's blocks can be
// scheduled before the kernel it depends on has ended. griddepcontrol.wait holds every thread until that kernel has
// completed and its writes are visible, so nothing is read or overwritten early; as every kernel waits so, the
// chain orders each kernel after all earlier ones. No kernel signals its dependents early
// (griddepcontrol.launch_dependents): when they may start is the graph edge's choice (the port), made on the host.
// Outside such a graph (a prepared launch, a plain edge) the wait returns at once. sm_90 and later.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define AFTER_PREVIOUS_GRID() asm volatile("griddepcontrol.wait;" ::: "memory")
#else
#define AFTER_PREVIOUS_GRID() do { } while (0)
#endif

__device__ __forceinline__ float warp_sum(float v) {
    for (int off = WARP_SIZE / 2; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;   // every lane holds the same total
}

__device__ __forceinline__ float warp_max(float v) {
    for (int off = WARP_SIZE / 2; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

// Block-wide sum of BLOCK_THREADS values through shared memory `buf` [BLOCK_THREADS]; fixed tree.
__device__ __forceinline__ float block_sum(float v, float* buf) {
    buf[threadIdx.x] = v;
    __syncthreads();
    for (int half = BLOCK_THREADS / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) buf[threadIdx.x] += buf[threadIdx.x + half];
        __syncthreads();
    }
    float total = buf[0];
    __syncthreads();            // buf may be reused right after
    return total;
}

__device__ __forceinline__ float block_max(float v, float* buf) {
    buf[threadIdx.x] = v;
    __syncthreads();
    for (int half = BLOCK_THREADS / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) buf[threadIdx.x] = fmaxf(buf[threadIdx.x], buf[threadIdx.x + half]);
        __syncthreads();
    }
    float m = buf[0];
    __syncthreads();
    return m;
}

// x / (1 + exp(-x)) and 1 / (1 + exp(-x)) as refmodel writes them (float32 expf: <= 2 ulp).
__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Dense weights reach the kernels as float32 or as bfloat16 (K2.6 stores its attention projections, shared
// expert, dense MLP, embedding and lm_head so; the engine keeps them so: half the bytes). A kernel that reads
// weights is a template over the element type WT with one extern "C" instance per type (`name_kernel` float32,
// `name_bf16_kernel` raw bf16 bits); wval widens an element exactly (a bf16 value is the top half of its float32),
// so both instances do the same float32 arithmetic on the same values and give the same bits. One exception: a
// linear of 2 or more rows with bf16 weights runs linear_mma_bf16_kernel (tensor cores, linear.cu), which has no
// float32 instance; the float32 weights' rows run linear_rows_kernel.
typedef unsigned short bf16_t;
__device__ __forceinline__ float wval(float w) { return w; }
__device__ __forceinline__ float wval(bf16_t w) { return __uint_as_float((unsigned)w << 16); }
