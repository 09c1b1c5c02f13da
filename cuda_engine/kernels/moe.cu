// MoE: the sigmoid noaux_tc router, the SwiGLU experts and the weighted combine. The dense MLP and the
// shared expert run through the same two expert kernels (a dense MLP is one slot of expert 0).
//
// Slots: each token has S = K + n_shared slots; slot k < K holds a routed expert id and its weight,
// slot K (when n_shared_experts = 1) holds the shared expert, stacked after the routed ones at id E,
// weight 1. Expert weights are stacked: gate/up [E', I, D], down [E', D, I] (E' = E + n_shared).
//
//   router_kernel:         scores = sigmoid(logits) [T, E]; choice = scores + bias (selection only);
//                          with n_group > 1 keep the topk_group groups with the largest top-2 sums;
//                          top-K of choice, ties to the lower id; weights = scores[ids], renormalised
//                          (sum + 1e-20) if norm_topk_prob, times routed_scaling_factor.
//                          Launch grid (T), block BLOCK_THREADS; thread 0 selects (K * E compares: tiny
//                          next to the expert GEMVs, and obviously the oracle's stable order).
//   swiglu_gate_up_kernel: act[t, k] = silu(Wg[e] x[t]) * (Wu[e] x[t]), e = slot_ids[t, k]  [T * S, I].
//                          Launch grid (ceil(I / WARPS_PER_BLOCK), T * S), one warp per (slot, i).
//   expert_down_kernel:    y[t, k] = Wd[e] act[t, k]  [T * S, D]. Launch grid (ceil(D / WARPS_PER_BLOCK), T * S).
//   moe_combine_kernel:    out[t] = sum over routed slots in ascending expert id of w * y, then + the
//                          unweighted slots (shared expert) in slot order: the oracle's summation order.
//                          Launch grid (T), block BLOCK_THREADS.
// Limits: E <= ROUTER_MAX_E, n_group <= ROUTER_MAX_GROUPS, S <= MOE_MAX_SLOTS (shared-memory arrays).
#include "common.cuh"

#define ROUTER_MAX_E 1024
#define ROUTER_MAX_GROUPS 64
#define MOE_MAX_SLOTS 64

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS)
router_kernel(const float* __restrict__ logits, const float* __restrict__ bias, float* __restrict__ scores,
              int* __restrict__ slot_ids, float* __restrict__ slot_w, int E, int K, int S, int n_group,
              int topk_group, int norm_topk_prob, float routed_scaling_factor) {
    __shared__ float choice[ROUTER_MAX_E];
    __shared__ unsigned char taken[ROUTER_MAX_E];
    __shared__ float gscore[ROUTER_MAX_GROUPS];
    __shared__ bool keep[ROUTER_MAX_GROUPS];
    const int t = blockIdx.x;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const float s = sigmoid(logits[(size_t)t * E + e]);
        scores[(size_t)t * E + e] = s;
        choice[e] = s + bias[e];
        taken[e] = 0;
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    const float* sc = scores + (size_t)t * E;
    if (n_group > 1) {                                        // group-limited selection
        const int per = E / n_group;
        for (int g = 0; g < n_group; ++g) {
            float b1 = -INFINITY, b2 = -INFINITY;             // largest, second largest
            for (int j = 0; j < per; ++j) {
                const float v = choice[g * per + j];
                if (v > b1) { b2 = b1; b1 = v; } else if (v > b2) { b2 = v; }
            }
            gscore[g] = b2 + b1;
            keep[g] = false;
        }
        for (int r = 0; r < topk_group; ++r) {
            int best = -1;
            for (int g = 0; g < n_group; ++g)
                if (!keep[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
            keep[best] = true;
        }
        for (int e = 0; e < E; ++e) if (!keep[e / per]) choice[e] = -INFINITY;
    }
    float sum = 0.0f;
    for (int k = 0; k < K; ++k) {                             // top-K, ties to the lower id
        int best = -1;
        for (int e = 0; e < E; ++e)
            if (!taken[e] && (best < 0 || choice[e] > choice[best])) best = e;
        taken[best] = 1;
        slot_ids[(size_t)t * S + k] = best;
        slot_w[(size_t)t * S + k] = sc[best];
        sum += sc[best];
    }
    for (int k = 0; k < K; ++k) {
        float w = slot_w[(size_t)t * S + k];
        if (norm_topk_prob) w = w / (sum + 1e-20f);
        slot_w[(size_t)t * S + k] = w * routed_scaling_factor;
    }
    for (int k = K; k < S; ++k) { slot_ids[(size_t)t * S + k] = E + (k - K); slot_w[(size_t)t * S + k] = 1.0f; }
}

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS)
swiglu_gate_up_kernel(const float* __restrict__ x, const float* __restrict__ Wg, const float* __restrict__ Wu,
                      const int* __restrict__ slot_ids, float* __restrict__ act, int D, int I, int S) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int i = blockIdx.x * WARPS_PER_BLOCK + threadIdx.x / WARP_SIZE;
    if (i >= I) return;
    const int ts = blockIdx.y, t = ts / S;
    const size_t e = (size_t)slot_ids[ts];
    const float* xr = x + (size_t)t * D;
    const float* g = Wg + (e * I + i) * D;
    const float* u = Wu + (e * I + i) * D;
    float ag = 0.0f, au = 0.0f;
    for (int d = lane; d < D; d += WARP_SIZE) { ag += xr[d] * g[d]; au += xr[d] * u[d]; }
    ag = warp_sum(ag);
    au = warp_sum(au);
    if (lane == 0) act[(size_t)ts * I + i] = silu(ag) * au;
}

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS)
expert_down_kernel(const float* __restrict__ act, const float* __restrict__ Wd, const int* __restrict__ slot_ids,
                   float* __restrict__ y, int I, int D) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int d = blockIdx.x * WARPS_PER_BLOCK + threadIdx.x / WARP_SIZE;
    if (d >= D) return;
    const int ts = blockIdx.y;
    const size_t e = (size_t)slot_ids[ts];
    const float* a = act + (size_t)ts * I;
    const float* w = Wd + (e * D + d) * I;
    float acc = 0.0f;
    for (int i = lane; i < I; i += WARP_SIZE) acc += a[i] * w[i];
    acc = warp_sum(acc);
    if (lane == 0) y[(size_t)ts * D + d] = acc;
}

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS)
moe_combine_kernel(const float* __restrict__ y, const int* __restrict__ slot_ids, const float* __restrict__ slot_w,
                   float* __restrict__ out, int K, int S, int D) {
    __shared__ int order[MOE_MAX_SLOTS];
    const int t = blockIdx.x;
    const int* ids = slot_ids + (size_t)t * S;
    for (int k = threadIdx.x; k < K; k += blockDim.x) {       // routed slots by ascending expert id:
        int rank = 0;                                         // a slot's rank = how many ids sort before it
        for (int j = 0; j < K; ++j) rank += ids[j] < ids[k] || (ids[j] == ids[k] && j < k);
        order[rank] = k;
    }
    __syncthreads();
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < K; ++j) {
            const int k = order[j];
            acc = __fadd_rn(acc, __fmul_rn(slot_w[(size_t)t * S + k], y[((size_t)t * S + k) * D + d]));
        }
        for (int k = K; k < S; ++k) acc = __fadd_rn(acc, y[((size_t)t * S + k) * D + d]);
        out[(size_t)t * D + d] = acc;
    }
}
