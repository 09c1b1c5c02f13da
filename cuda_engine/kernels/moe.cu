// MoE: the sigmoid noaux_tc router, the SwiGLU experts and the weighted combine. The dense MLP and the
// shared expert run through the same two expert kernels (a dense MLP is one slot of expert 0).
//
// Slots: each token has S = K + n_shared slots; slot k < K holds a routed expert id and its weight,
// slot K (when n_shared_experts = 1) holds the shared expert, stacked after the routed ones at id E,
// weight 1. Expert weights are stacked: gate/up [E', I, D], down [E', D, I] (E' = E + n_shared).
//
//   router_kernel:         scores [T, E] holds the logits gate x[t] on entry (ops.linear, mlp.gate.weight [E, D]:
//                          a warp per expert row over many blocks; one block per token streaming the gate was
//                          11 MB through one SM per token at K2.6's 384 x 7168, ~200 us); scores =
//                          sigmoid(logits) in place [T, E]; choice = scores + bias (selection only);
//                          with n_group > 1 keep the topk_group groups with the largest top-2 sums;
//                          top-K of choice, ties to the lower id; weights = scores[ids], renormalised
//                          (sum + 1e-20) if norm_topk_prob, times routed_scaling_factor.
//                          Launch grid (T), block BLOCK_THREADS;
//                          warp 0 selects: K rounds of a warp
//                          argmax with ties to the lower id (the oracle's stable order).
//                          Held routing (optional; the conformance runner's hold_routing): own_ids/own_w
//                          [T, K] receive the router's own choice and its weights (the topk_ids and
//                          topk_weights taps); a row of held [T, K] whose first id is >= 0 replaces the
//                          experts the slots run by the held ones, weighted from this router's scores at
//                          those ids (renormalised, scaled) as refmodel's forced routing does; a row of -1
//                          keeps the router's choice. held lives in a device buffer, so a captured decode
//                          graph reads whatever the host wrote for this replay. Null pointers: no hold, no
//                          own copy (the slots are then the router's choice).
//   swiglu_gate_up_kernel: act[t, k] = silu(Wg[e] x[t]) * (Wu[e] x[t]), e = slot_ids[t, k] - e_base  [T * S, I],
//                          for the slots k0 .. k0+nk-1 (all S; or, when the routed experts are INT4
//                          (w4a16_plain.cu), only the dense shared expert's slot, e_base = E).
//                          Launch grid (ceil(I / WARPS_PER_BLOCK), T * nk), one warp per (slot, i).
//   expert_down_kernel:    y[t, k] = Wd[e] act[t, k]  [T * S, D], same slots; `per` outputs a warp (1 .. 4).
//                          Launch grid (ceil(D / (WARPS_PER_BLOCK per)), T * nk).
//   moe_combine_kernel:    out[t] = sum over routed slots in ascending expert id of w * y, then + the
//                          unweighted slots (shared expert) in slot order: the oracle's summation order.
//                          Fused with the block's end (one launch fewer per layer): h_out = h + out and
//                          y_norm = rms_norm(h_out, w_norm) (the next layer's input norm or the final norm).
//                          Launch grid (ceil(D / COMBINE_DSLICE), T), block BLOCK_THREADS: a block owns a slice
//                          of COMBINE_DSLICE elements of the row, one per thread, each thread with its slots'
//                          loads of y in flight together (COMBINE_J at a time; the sums keep the order above,
//                          so out and h_out do not depend on the launch shape). The norm needs the whole row:
//                          each block writes its slice's sum of squares to partials [T, gridDim.x]; the last
//                          block of a token to finish (a ticket per token, tickets [T]: zero before the launch,
//                          left zero by that block) adds them in block order and writes y_norm for the row.
//                          Deterministic: no float atomics.
//   moe_group_kernel:      the grouped MoE path's work list (a forward of T > 1 tokens on the fast W4A16 kernel,
//                          kernels/w4a16_mma.cu): the (token, slot) pairs ts = t S + k, k in k0 .. k0+nk-1,
//                          grouped by expert e = slot_ids[ts] - e_base in [0, E): experts ascending, each
//                          expert's pairs in ascending ts, cut into chunks of at most MT (the launch entry's
//                          tokens). Writes groups[0] = n groups, groups[1 + 3 z ..] = (e + e_base, first pair
//                          p, count m) for z < n, and the pairs (their ts, in group order) at groups[1 + 3 Z +
//                          p ..]; Z is the grid z of the launches that read it (n <= Z: ops.w4a16_groups_cap).
//                          Deterministic: integer counts, exclusive scans in thread order, then one warp places
//                          the pairs in ts order (a round of 32 ranks equal experts with __match_any_sync), a
//                          stable counting sort. Launch grid (1), block BLOCK_THREADS.
// Limits: E <= ROUTER_MAX_E, n_group <= ROUTER_MAX_GROUPS, S <= MOE_MAX_SLOTS (shared-memory arrays);
// moe_group_kernel: E <= MOE_GROUP_MAX_E (the routed experts and the shared one).
#include "common.cuh"

#define ROUTER_MAX_E 1024
#define ROUTER_MAX_GROUPS 64
#define MOE_MAX_SLOTS 64
#define MOE_GROUP_MAX_E (ROUTER_MAX_E + 1)

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
router_kernel(const float* __restrict__ bias, float* __restrict__ scores, int* __restrict__ slot_ids, float* __restrict__ slot_w, int E, int K, int S,
              int n_group,
              int topk_group, int norm_topk_prob, float routed_scaling_factor, const int* __restrict__ held,
              int* __restrict__ own_ids, float* __restrict__ own_w) {
    AFTER_PREVIOUS_GRID();
    __shared__ float choice[ROUTER_MAX_E];
    __shared__ unsigned char taken[ROUTER_MAX_E];
    __shared__ float gscore[ROUTER_MAX_GROUPS];
    __shared__ bool keep[ROUTER_MAX_GROUPS];
    __shared__ float ssc[ROUTER_MAX_E];                       // the sigmoid scores, for the selected weights
    __shared__ float w_sel[MOE_MAX_SLOTS];
    __shared__ int id_sel[MOE_MAX_SLOTS];
    const int t = blockIdx.x, lane = threadIdx.x % WARP_SIZE;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {       // the logits in, the sigmoid scores out, in place
        const float s = sigmoid(scores[(size_t)t * E + e]);
        scores[(size_t)t * E + e] = s;
        ssc[e] = s;
        choice[e] = s + bias[e];
        taken[e] = 0;
    }
    __syncthreads();
    if (threadIdx.x >= WARP_SIZE) return;                     // selection: warp 0
    if (n_group > 1 && lane == 0) {                           // group-limited selection (thread 0: G is small)
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
    __syncwarp();
    // top-K, ties to the lower id: each round, every lane finds its best untaken expert (ids lane, lane+32,
    // ...), then a butterfly keeps the (larger choice, lower id) pair: the same order as a stable sort.
    float sum = 0.0f;
    for (int k = 0; k < K; ++k) {
        float bv = -INFINITY;
        int bi = -1;
        for (int e = lane; e < E; e += WARP_SIZE)
            if (!taken[e] && (bi < 0 || choice[e] > bv)) { bv = choice[e]; bi = e; }
        for (int off = WARP_SIZE / 2; off > 0; off >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
            if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) { bv = ov; bi = oi; }
        }
        if (lane == 0) { taken[bi] = 1; id_sel[k] = bi; w_sel[k] = ssc[bi]; }   // every lane holds the same bi
        __syncwarp();
        sum += ssc[bi];
    }
    if (lane != 0) return;
    if (own_ids != nullptr)                                   // the router's own choice: the taps
        for (int k = 0; k < K; ++k) {
            own_ids[(size_t)t * K + k] = id_sel[k];
            own_w[(size_t)t * K + k] = (norm_topk_prob ? w_sel[k] / (sum + 1e-20f) : w_sel[k]) * routed_scaling_factor;
        }
    if (held != nullptr && held[(size_t)t * K] >= 0) {        // a held row: run these experts instead
        sum = 0.0f;
        for (int k = 0; k < K; ++k) {
            id_sel[k] = held[(size_t)t * K + k];
            w_sel[k] = ssc[id_sel[k]];
            sum += w_sel[k];
        }
    }
    for (int k = 0; k < K; ++k) {
        float w = w_sel[k];
        if (norm_topk_prob) w = w / (sum + 1e-20f);
        slot_ids[(size_t)t * S + k] = id_sel[k];
        slot_w[(size_t)t * S + k] = w * routed_scaling_factor;
    }
    for (int k = K; k < S; ++k) { slot_ids[(size_t)t * S + k] = E + (k - K); slot_w[(size_t)t * S + k] = 1.0f; }
}

// The dense experts (float32 Wg, Wu, Wd, or bf16 bits in the _bf16_ instances: common.cuh, wval)
template <typename WT>
__device__ __forceinline__ void swiglu_gate_up_body(const float* __restrict__ x, const WT* __restrict__ Wg,
                                                    const WT* __restrict__ Wu, const int* __restrict__ slot_ids,
                                                    float* __restrict__ act, int D, int I, int S, int k0, int nk,
                                                    int e_base) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int i = blockIdx.x * WARPS_PER_BLOCK + threadIdx.x / WARP_SIZE;
    if (i >= I) return;
    const int t = blockIdx.y / nk, ts = t * S + k0 + blockIdx.y % nk;
    const size_t e = (size_t)(slot_ids[ts] - e_base);
    const float* xr = x + (size_t)t * D;
    const WT* g = Wg + (e * I + i) * D;
    const WT* u = Wu + (e * I + i) * D;
    float ag = 0.0f, au = 0.0f;
    for (int d = lane; d < D; d += WARP_SIZE) { ag += xr[d] * wval(g[d]); au += xr[d] * wval(u[d]); }
    ag = warp_sum(ag);
    au = warp_sum(au);
    if (lane == 0) act[(size_t)ts * I + i] = silu(ag) * au;
}

#define SWIGLU_ARGS(WT) const float* __restrict__ x, const WT* __restrict__ Wg, const WT* __restrict__ Wu, \
    const int* __restrict__ slot_ids, float* __restrict__ act, int D, int I, int S, int k0, int nk, int e_base
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM) swiglu_gate_up_kernel(SWIGLU_ARGS(float)) {
    AFTER_PREVIOUS_GRID();
    swiglu_gate_up_body(x, Wg, Wu, slot_ids, act, D, I, S, k0, nk, e_base);
}
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
swiglu_gate_up_bf16_kernel(SWIGLU_ARGS(bf16_t)) {
    AFTER_PREVIOUS_GRID();
    swiglu_gate_up_body(x, Wg, Wu, slot_ids, act, D, I, S, k0, nk, e_base);
}

// A warp computes `per` (1 .. EXPERT_DOWN_MAX_PER) consecutive outputs d0 .. d0+per-1 of its slot, their loads in
// flight together; each output is summed as with one a warp (lane-strided products, then warp_sum), so the bits do
// not depend on `per`. The host (Ops.expert_down, down_outputs_per_warp) takes more a warp where the grid of one
// a warp would run in several waves: the tiny models' verify (D = 192 over 33 x 5 slots: 3960 blocks of 8 warps
// that each summed 64 products, several waves) and K2.6's 5-row shared expert.
#define EXPERT_DOWN_MAX_PER 4
template <typename WT>
__device__ __forceinline__ void expert_down_body(const float* __restrict__ act, const WT* __restrict__ Wd,
                                                 const int* __restrict__ slot_ids, float* __restrict__ y, int I, int D,
                                                 int S, int k0, int nk, int e_base, int per) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int d0 = (blockIdx.x * WARPS_PER_BLOCK + threadIdx.x / WARP_SIZE) * per;
    if (d0 >= D) return;
    const int nd = min(per, D - d0);                          // the same for every lane of the warp
    const int ts = (blockIdx.y / nk) * S + k0 + blockIdx.y % nk;
    const size_t e = (size_t)(slot_ids[ts] - e_base);
    const float* a = act + (size_t)ts * I;
    const WT* w = Wd + (e * D + d0) * I;
    float acc[EXPERT_DOWN_MAX_PER] = {};
    for (int i = lane; i < I; i += WARP_SIZE) {
        const float ai = a[i];
#pragma unroll
        for (int r = 0; r < EXPERT_DOWN_MAX_PER; ++r)
            if (r < nd) acc[r] += ai * wval(w[(size_t)r * I + i]);
    }
#pragma unroll
    for (int r = 0; r < EXPERT_DOWN_MAX_PER; ++r) {
        if (r >= nd) break;
        const float sum = warp_sum(acc[r]);
        if (lane == 0) y[(size_t)ts * D + d0 + r] = sum;
    }
}

#define EXPERT_DOWN_ARGS(WT) const float* __restrict__ act, const WT* __restrict__ Wd, const int* __restrict__ slot_ids, \
    float* __restrict__ y, int I, int D, int S, int k0, int nk, int e_base, int per
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM) expert_down_kernel(EXPERT_DOWN_ARGS(float)) {
    AFTER_PREVIOUS_GRID();
    expert_down_body(act, Wd, slot_ids, y, I, D, S, k0, nk, e_base, per);
}
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
expert_down_bf16_kernel(EXPERT_DOWN_ARGS(bf16_t)) {
    AFTER_PREVIOUS_GRID();
    expert_down_body(act, Wd, slot_ids, y, I, D, S, k0, nk, e_base, per);
}

// The combine, spread over the row: block (bx, t) owns d = bx * COMBINE_DSLICE + threadIdx.x, one element per
// thread, so K2.6's D = 7168 runs on 28 blocks per token rather than one (one block walked 7168 x 9 values in
// ~21 dependent L2 round trips: 18% of a one-token MoE layer). Each thread issues its slots' loads of y
// COMBINE_J at a time (K2.6's S = 9: all at once) before the sums that need them; the blocks of a token are
// independent until the norm (below), so the row's loads are in flight on 28 SMs at once.
#define COMBINE_DSLICE BLOCK_THREADS
#define COMBINE_J 16
// The last block's y_norm pass: COMBINE_NORM_U elements of h_out and w_norm per thread in flight per trip
// (D = 7168: 28 per thread, two trips).
#define COMBINE_NORM_U 16
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
moe_combine_kernel(const float* __restrict__ y, const int* __restrict__ slot_ids, const float* __restrict__ slot_w,
                   float* __restrict__ out, int K, int S, int D, const float* __restrict__ h,
                   float* __restrict__ h_out, const float* __restrict__ w_norm, float* __restrict__ y_norm, float eps,
                   float* __restrict__ partials, int* __restrict__ tickets) {
    AFTER_PREVIOUS_GRID();
    __shared__ int ids[MOE_MAX_SLOTS];
    __shared__ float ws[MOE_MAX_SLOTS];
    __shared__ int order[MOE_MAX_SLOTS];                      // summation order: slot of the j-th term
    __shared__ float w_ord[MOE_MAX_SLOTS];
    __shared__ float buf[BLOCK_THREADS];
    __shared__ bool is_last;
    __shared__ float inv_s;
    const int t = blockIdx.y, nblk = gridDim.x, k = threadIdx.x;
    const int d = blockIdx.x * COMBINE_DSLICE + threadIdx.x;
    const size_t row = (size_t)t * D;
    const float hv = d < D ? h[row + d] : 0.0f;               // in flight with the slots' ids and weights
    if (k < S) {
        ids[k] = slot_ids[(size_t)t * S + k];
        ws[k] = slot_w[(size_t)t * S + k];
    }
    __syncthreads();
    if (k < S) {                                              // routed slots by ascending expert id (ties: slot
        if (k >= K) {                                         // order), then the unweighted (shared) slots in
            order[k] = k;                                     // slot order
        } else {
            int rank = 0;                                     // a slot's rank = how many ids sort before it
            for (int j = 0; j < K; ++j) rank += ids[j] < ids[k] || (ids[j] == ids[k] && j < k);
            order[rank] = k;
            w_ord[rank] = ws[k];
        }
    }
    __syncthreads();
    float vv = 0.0f;
    if (d < D) {
        const float* yt = y + row * S + d;                    // y [T * S, D]: token t's slot k is row t S + k
        float acc = 0.0f;
        for (int j0 = 0; j0 < S; j0 += COMBINE_J) {
            float v[COMBINE_J];
#pragma unroll
            for (int jj = 0; jj < COMBINE_J; ++jj)             // past S: slot S - 1 again (an L1 hit, unused):
                v[jj] = __ldg(yt + (size_t)order[min(j0 + jj, S - 1)] * D);   // with a predicate per load, ptxas
                // (sm_90 SASS) put sums between the loads: two or three L2 trips, or one per slot with a break
#pragma unroll
            for (int jj = 0; jj < COMBINE_J; ++jj) {           // the same sums, in the same order, as one at a time
                const int j = j0 + jj;
                const float term = j < K ? __fmul_rn(w_ord[j], v[jj]) : v[jj];
                if (j < S) acc = __fadd_rn(acc, term);
            }
        }
        out[row + d] = acc;
        vv = hv + acc;                                        // the residual add and the next RMSNorm,
        h_out[row + d] = vv;                                  // as add_rms_norm_kernel (norm.cu)
    }
    // The norm needs the whole row's sum of squares: each block leaves its slice's (a fixed tree) in
    // partials [T, nblk]; the last block of token t to finish (elected by a ticket; the ticket orders no
    // arithmetic) adds them in block order and writes y_norm for the whole row: the same bits every run.
    const float part = block_sum(vv * vv, buf);
    if (threadIdx.x == 0) partials[(size_t)t * nblk + blockIdx.x] = part;
    __threadfence();                                          // h_out and the partial, visible before the ticket
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(&tickets[t], 1) == nblk - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    float total = 0.0f;                                       // thread 0's, in block order
    for (int b0 = 0; b0 < nblk; b0 += BLOCK_THREADS) {        // the partials staged a block's width at a time
        // (L2 loads: other blocks wrote these; this SM's L1 holds no copy the ticket would have ordered)
        if (b0 + threadIdx.x < nblk) buf[threadIdx.x] = __ldcg(&partials[(size_t)t * nblk + b0 + threadIdx.x]);
        __syncthreads();
        if (threadIdx.x == 0)
            for (int b = 0; b < BLOCK_THREADS && b0 + b < nblk; ++b) total += buf[b];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        inv_s = 1.0f / sqrtf(total / (float)D + eps);
        tickets[t] = 0;                                       // ready for the next launch (graph replays)
    }
    __syncthreads();
    const float inv = inv_s;
    for (int d0 = threadIdx.x; d0 < D; d0 += COMBINE_NORM_U * BLOCK_THREADS) {
        float hn[COMBINE_NORM_U], wn[COMBINE_NORM_U];
#pragma unroll
        for (int u = 0; u < COMBINE_NORM_U; ++u) {            // past D: element D - 1 again (unused), so the
            const int dd = min(d0 + u * BLOCK_THREADS, D - 1);  // loads carry no predicate between them
            hn[u] = __ldcg(&h_out[row + dd]);                 // (other blocks' slices: L2, as the partials)
            wn[u] = w_norm[dd];
        }
#pragma unroll
        for (int u = 0; u < COMBINE_NORM_U; ++u) {
            const int dd = d0 + u * BLOCK_THREADS;
            if (dd < D) y_norm[row + dd] = wn[u] * (hn[u] * inv);
        }
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
moe_group_kernel(const int* __restrict__ slot_ids, int T, int S, int k0, int nk, int e_base, int E, int MT, int Z,
                 int* __restrict__ groups) {
    AFTER_PREVIOUS_GRID();
    constexpr int PER = (MOE_GROUP_MAX_E + BLOCK_THREADS - 1) / BLOCK_THREADS;   // experts per thread
    __shared__ int cnt[MOE_GROUP_MAX_E], off[MOE_GROUP_MAX_E];
    __shared__ int wsum[2][WARPS_PER_BLOCK];
    const int P = T * nk, lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    auto pair_ts = [&](int p) { return (p / nk) * S + k0 + p % nk; };
    for (int i = threadIdx.x; i < E; i += blockDim.x) cnt[i] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
        const int e = slot_ids[pair_ts(p)] - e_base;
        if (0 <= e && e < E) atomicAdd(&cnt[e], 1);            // (ids outside the range: not this launch's)
    }
    __syncthreads();
    // thread i owns experts PER i .. PER i + PER - 1: its pairs and groups, then exclusive scans in thread order
    const int e0 = threadIdx.x * PER;
    int sp = 0, sg = 0;
    for (int j = 0; j < PER && e0 + j < E; ++j) sp += cnt[e0 + j], sg += (cnt[e0 + j] + MT - 1) / MT;
    int ip = sp, ig = sg;                                       // inclusive scans within the warp
    for (int d = 1; d < WARP_SIZE; d <<= 1) {
        const int a = __shfl_up_sync(0xffffffffu, ip, d), b = __shfl_up_sync(0xffffffffu, ig, d);
        if (lane >= d) ip += a, ig += b;
    }
    if (lane == WARP_SIZE - 1) wsum[0][warp] = ip, wsum[1][warp] = ig;
    __syncthreads();
    for (int w = 0; w < warp; ++w) ip += wsum[0][w], ig += wsum[1][w];
    if (threadIdx.x == blockDim.x - 1) groups[0] = ig;         // every group
    int p = ip - sp, gq = ig - sg;                             // this thread's first pair and group
    for (int j = 0; j < PER && e0 + j < E; ++j) {
        const int e = e0 + j;
        off[e] = p;
        for (int c = 0; c < cnt[e] && gq < Z; c += MT, ++gq) {
            int* gz = groups + 1 + 3 * gq;
            gz[0] = e + e_base, gz[1] = p + c, gz[2] = min(MT, cnt[e] - c);
        }
        p += cnt[e];
    }
    __syncthreads();
    if (warp != 0) return;
    int* pairs = groups + 1 + 3 * Z;
    for (int p0 = 0; p0 < P; p0 += WARP_SIZE) {                // the pairs in ts order, 32 at a time
        const int pp = p0 + lane, ts = pp < P ? pair_ts(pp) : 0, id = pp < P ? slot_ids[ts] - e_base : -1;
        const int e = 0 <= id && id < E ? id : -1;
        const unsigned same = __match_any_sync(0xffffffffu, e);
        const int rank = __popc(same & ((1u << lane) - 1u)), o = e >= 0 ? off[e] : 0;
        __syncwarp();
        if (e >= 0) {
            pairs[o + rank] = ts;
            if (rank == __popc(same) - 1) off[e] = o + __popc(same);   // the last of its expert moves it on
        }
        __syncwarp();
    }
}
