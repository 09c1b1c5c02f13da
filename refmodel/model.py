"""Kimi K2.6 (DeepSeek-V3) forward pass in float64 NumPy: MLA (naive and absorbed), YaRN RoPE, sigmoid noaux_tc MoE.

Math: docs/model.md (its sections in brackets below). Weights are a dict with HF names (refmodel.weights);
every access is a plain dict lookup, so an INT4 dict dequantized by refmodel/quant.py works unchanged.
RoPE dims stay in the checkpoint's interleaved-pair layout [3]: our k_pe / q_pe tensors equal HF's de-interleaved
ones up to the fixed permutation P = [0, 2, ..., R-2, 1, 3, ..., R-1]; every dot product and the logits are the same.

Legend of dimensions:
    T  new tokens in this forward        S  keys attended (cached + new)     D  hidden_size
    H  num_attention_heads               Q  q_lora_rank                      C  kv_lora_rank
    R  qk_rope_head_dim                  N  qk_nope_head_dim                 A  qk_head_dim = N + R
    U  v_head_dim                        E  n_routed_experts                 K  num_experts_per_tok
    G  n_group                           I  MLP / expert width               V  vocab_size
"""
from __future__ import annotations

import numpy as np

from refmodel.config import ModelConfig

ATTN_TAPS = ("attn_in", "q", "kv_latent", "k_pe", "attn_out", "resid_attn", "mlp_in")
ROUTER_TAPS = ("router_scores", "topk_ids", "topk_weights")
OUT_TAPS = ("mlp_out", "resid_out")


def tap_names(cfg: ModelConfig, l: int) -> list[str]:
    """Tap names of layer l, in execution order (router taps only on MoE layers)."""
    moe = l >= cfg.first_k_dense_replace
    return list(ATTN_TAPS) + (list(ROUTER_TAPS) if moe else []) + list(OUT_TAPS)


def _tap(taps: dict | None, l: int, name: str, value: np.ndarray) -> None:
    if taps is not None:
        taps[f"L{l}/{name}"] = value.copy()


# ---------------------------------------------------------------- primitives

def weights_dtype(W) -> np.dtype:
    """The compute dtype of a weight mapping: a refmodel.stored.StoredWeights says it, a dict's
    embedding carries it."""
    dtype = getattr(W, "dtype", None)
    return np.dtype(dtype) if dtype is not None else W["model.embed_tokens.weight"].dtype


def embed_rows(W, ids: np.ndarray) -> np.ndarray:
    """Embedding rows [T, D] of ids [T]; a StoredWeights upcasts only these rows."""
    rows = getattr(W, "rows", None)
    return rows("model.embed_tokens.weight", ids) if rows is not None else W["model.embed_tokens.weight"][ids]


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return np.einsum("ti,oi->to", x, w)                                  # [T, in] -> [T, out]


def swiglu(W: dict, p: str, x: np.ndarray) -> np.ndarray:
    """down(silu(gate x) * up x): dense MLP, routed experts and the shared expert [5]."""
    g = linear(x, W[p + "gate_proj.weight"])                             # [T, D] -> [T, I]
    u = linear(x, W[p + "up_proj.weight"])                               # [T, D] -> [T, I]
    return linear(silu(g) * u, W[p + "down_proj.weight"])                # [T, I] -> [T, D]


def yarn_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Per-pair inverse frequencies, DeepSeek YaRN ramp between beta_fast and beta_slow [3]."""
    R, theta, rope = cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling
    inv_freq = 1.0 / theta ** (np.arange(0, R, 2, dtype=np.float64) / R)  # [R/2]
    if rope is None:
        return inv_freq

    def corr_dim(rotations: float) -> float:
        return R * np.log(rope["original_max_position_embeddings"] / (rotations * 2 * np.pi)) / (2 * np.log(theta))

    low, high = corr_dim(rope["beta_fast"]), corr_dim(rope["beta_slow"])
    if rope.get("truncate", True):
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0.0), min(high, R - 1.0)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(R // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)  # [R/2]
    return inv_freq * (1.0 - ramp) + inv_freq / rope["factor"] * ramp


def rope_cos_sin(cfg: ModelConfig, positions: np.ndarray, dtype=np.float64) -> tuple[np.ndarray, np.ndarray]:
    """Angles in float64 (positions up to 2^18 need it), then cast to the compute dtype."""
    angle = np.einsum("t,r->tr", positions.astype(np.float64), yarn_inv_freq(cfg))  # [T] -> [T, R/2]
    cos, sin = np.cos(angle) * cfg.rope_attention_factor, np.sin(angle) * cfg.rope_attention_factor
    return cos.astype(dtype), sin.astype(dtype)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate interleaved pairs (2i, 2i+1) by angle i; the output stays interleaved [3]. x: [T, ..., R]."""
    bshape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (cos.shape[1],)
    c, s = cos.reshape(bshape), sin.reshape(bshape)                      # [T, R/2] -> [T, 1.., R/2]
    x0, x1 = x[..., 0::2], x[..., 1::2]                                  # [T, .., R] -> 2 x [T, .., R/2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def causal_mask(T: int, S_cache: int) -> np.ndarray:
    """Additive [T, S_cache + T]: new token i sees the whole cache and new tokens j <= i."""
    j = np.arange(S_cache + T)[None, :]                                  # [1, S]
    i = np.arange(T)[:, None] + S_cache                                  # [T, 1]
    return np.where(j <= i, 0.0, -np.inf)                                # [T, S]


# ---------------------------------------------------------------- KV cache

class KVCache:
    """Per layer: c_kv[l] [S, C] (normalised latent) and k_pe[l] [S, R] (rotated, interleaved layout).
    Rows keep the dtype of the forward that wrote them (float64 oracle, float32 reference engine)."""

    def __init__(self, cfg: ModelConfig, dtype=np.float64):
        L, C, R = cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.c_kv = [np.zeros((0, C), dtype=dtype) for _ in range(L)]
        self.k_pe = [np.zeros((0, R), dtype=dtype) for _ in range(L)]

    @property
    def length(self) -> int:
        return self.c_kv[0].shape[0]

    def append(self, l: int, c_kv: np.ndarray, k_pe: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Append rows to layer l; returns the layer's full (c_kv [S, C], k_pe [S, R])."""
        self.c_kv[l] = np.concatenate([self.c_kv[l], c_kv])              # [S0, C] + [T, C] -> [S, C]
        self.k_pe[l] = np.concatenate([self.k_pe[l], k_pe])              # [S0, R] + [T, R] -> [S, R]
        return self.c_kv[l], self.k_pe[l]

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"KVCache.truncate({n}): n must be in [0, length={self.length}]")
        self.c_kv = [c[:n] for c in self.c_kv]
        self.k_pe = [k[:n] for k in self.k_pe]

    def compact(self, start: int, keep) -> None:
        """Rows start + keep[i] -> start + i, then truncate to start + len(keep) (DDTree accepted path)."""
        keep = np.asarray(keep, dtype=np.int64).reshape(-1)
        if not 0 <= start <= self.length:
            raise ValueError(f"KVCache.compact: start={start} must be in [0, length={self.length}]")
        if keep.size and (keep.min() < 0 or keep.max() >= self.length - start):
            raise ValueError(f"KVCache.compact: keep indices {keep.tolist()} must be in [0, {self.length - start})")
        rows = np.concatenate([np.arange(start), start + keep])          # [start + len(keep)]
        self.c_kv = [c[rows] for c in self.c_kv]
        self.k_pe = [k[rows] for k in self.k_pe]

    def copy(self) -> "KVCache":
        new = KVCache.__new__(KVCache)
        new.c_kv = [c.copy() for c in self.c_kv]
        new.k_pe = [k.copy() for k in self.k_pe]
        return new


# ---------------------------------------------------------------- attention (MLA) [4.2, 4.3]

def mla(cfg: ModelConfig, W: dict, l: int, x: np.ndarray, cos: np.ndarray, sin: np.ndarray,
        cache: KVCache | None, mask: np.ndarray, absorbed: bool, taps: dict | None) -> np.ndarray:
    p = f"model.layers.{l}.self_attn."
    H, N, R, C, U = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank,
                     cfg.v_head_dim)
    T = x.shape[0]
    c_q = rms_norm(linear(x, W[p + "q_a_proj.weight"]), W[p + "q_a_layernorm.weight"], cfg.latent_norm_eps)  # [T, Q]
    q = linear(c_q, W[p + "q_b_proj.weight"]).reshape(T, H, cfg.qk_head_dim)  # [T, Q] -> [T, H, A]
    q_nope, q_pe = q[..., :N], apply_rope(q[..., N:], cos, sin)          # [T, H, N], [T, H, R]
    kv = linear(x, W[p + "kv_a_proj_with_mqa.weight"])                   # [T, D] -> [T, C + R]
    # k_pe is split off before the latent norm and never normalised [4.2]
    c_kv = rms_norm(kv[:, :C], W[p + "kv_a_layernorm.weight"], cfg.latent_norm_eps)  # [T, C]
    k_pe = apply_rope(kv[:, C:], cos, sin)                               # [T, R]
    _tap(taps, l, "q", np.concatenate([q_nope, q_pe], axis=-1))          # [T, H, A]
    _tap(taps, l, "kv_latent", c_kv)
    _tap(taps, l, "k_pe", k_pe)
    if cache is not None:
        c_kv, k_pe = cache.append(l, c_kv, k_pe)                         # [T, .] -> [S, .]

    w_kvb = W[p + "kv_b_proj.weight"].reshape(H, N + U, C)               # [H(N+U), C] -> [H, N+U, C]
    w_uk, w_uv = w_kvb[:, :N], w_kvb[:, N:]                              # [H, N, C], [H, U, C]
    rope_scores = np.einsum("thr,sr->hts", q_pe, k_pe)                   # [H, T, S]
    if absorbed:
        q_lat = np.einsum("thn,hnc->thc", q_nope, w_uk)                  # [T, H, N] -> [T, H, C]
        scores = np.einsum("thc,sc->hts", q_lat, c_kv) + rope_scores     # [H, T, S]
        probs = softmax(scores * cfg.softmax_scale + mask)               # [H, T, S]
        o_lat = np.einsum("hts,sc->thc", probs, c_kv)                    # [H, T, S] -> [T, H, C]
        o = np.einsum("thc,huc->thu", o_lat, w_uv)                       # [T, H, C] -> [T, H, U]
    else:  # kv_b_proj as the Linear it is (BLAS; c_einsum is ~5x slower on the long expansion)
        kv = linear(c_kv, W[p + "kv_b_proj.weight"]).reshape(-1, H, N + U)  # [S, C] -> [S, H, N+U]
        k_nope, v = kv[..., :N], kv[..., N:]                             # [S, H, N], [S, H, U]
        scores = np.einsum("thn,shn->hts", q_nope, k_nope) + rope_scores  # [H, T, S]
        probs = softmax(scores * cfg.softmax_scale + mask)               # [H, T, S]
        o = np.einsum("hts,shu->thu", probs, v)                          # [H, T, S] -> [T, H, U]
    return linear(o.reshape(T, H * U), W[p + "o_proj.weight"])           # [T, H, U] -> [T, HU] -> [T, D]


# ---------------------------------------------------------------- MoE [5.1, 5.2]

def _topk_stable(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest per row, ordered by (-score, index): ties go to the lower index."""
    return np.argsort(-scores, axis=-1, kind="stable")[:, :k]            # [T, X] -> [T, k]


def select_experts(cfg: ModelConfig, choice: np.ndarray) -> np.ndarray:
    """The top-K experts [T, K] of biased routing scores `choice` [T, E]: with groups (n_group > 1) only
    the topk_group groups with the largest top-2 sums compete."""
    T, E, G = choice.shape[0], cfg.n_routed_experts, cfg.n_group
    if G > 1:
        grouped = choice.reshape(T, G, E // G)                           # [T, E] -> [T, G, E/G]
        group_score = np.sort(grouped, axis=-1)[..., -2:].sum(-1)        # top-2 sum: [T, G]
        kept = _topk_stable(group_score, cfg.topk_group)                 # [T, topk_group]
        keep = np.zeros((T, G), dtype=bool)
        np.put_along_axis(keep, kept, True, axis=-1)
        choice = np.where(np.repeat(keep, E // G, axis=-1), choice, -np.inf)  # [T, G] -> [T, E]
    return _topk_stable(choice, cfg.num_experts_per_tok)                 # [T, K]


def route(cfg: ModelConfig, W: dict, l: int, x: np.ndarray,
          forced: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sigmoid noaux_tc router: (scores [T, E] unbiased, ids [T, K], weights [T, K]). `forced` [T, K]:
    use these expert ids instead of the router's choice (weights still from this run's scores); a row of
    -1 leaves that row to the router."""
    p = f"model.layers.{l}.mlp.gate."
    scores = sigmoid(linear(x, W[p + "weight"]))                         # [T, D] -> [T, E]
    choice = scores + W[p + "e_score_correction_bias"]                   # bias chooses experts, never weighs them
    ids = select_experts(cfg, choice)                                    # [T, E] -> [T, K]
    if forced is not None:
        forced = np.asarray(forced, np.int64)                            # [T, K]
        ids = np.where((forced < 0).all(-1, keepdims=True), ids, forced)
    return scores, ids, expert_weights(cfg, scores, ids)


def expert_weights(cfg: ModelConfig, scores: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The weights [T, K] of experts `ids` [T, K] from unbiased scores [T, E]: gathered, renormalised
    (norm_topk_prob), scaled by routed_scaling_factor."""
    weights = np.take_along_axis(scores, ids, axis=-1)                   # [T, K], unbiased
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor


def moe(cfg: ModelConfig, W: dict, l: int, x: np.ndarray, taps: dict | None,
        forced: np.ndarray | None = None) -> np.ndarray:
    """`forced` [T, K]: run these experts (a noise measurement with routing held fixed); the topk_ids
    tap then records the router's own choice, so its flips can still be counted."""
    p = f"model.layers.{l}.mlp."
    scores, ids, weights = route(cfg, W, l, x, forced)                   # [T, E], [T, K], [T, K]
    _tap(taps, l, "router_scores", scores)
    own = ids if forced is None else select_experts(cfg, scores + W[p + "gate.e_score_correction_bias"])
    _tap(taps, l, "topk_ids", np.asarray(own).astype(np.int64))
    _tap(taps, l, "topk_weights", weights)
    y = np.zeros_like(x)                                                 # [T, D]
    for e in np.unique(ids):                                             # ascending expert id, as HF
        tok, slot = np.nonzero(ids == e)                                 # tokens routed to e, their k slot
        y[tok] += weights[tok, slot, None] * swiglu(W, p + f"experts.{e}.", x[tok])  # [t_e, D]
    if cfg.n_shared_experts:
        y = y + swiglu(W, p + "shared_experts.", x)                      # shared expert: not scaled
    return y


# ---------------------------------------------------------------- block and model [2]

def block(cfg: ModelConfig, W: dict, l: int, h: np.ndarray, cos: np.ndarray, sin: np.ndarray,
          cache: KVCache | None, mask: np.ndarray, absorbed: bool, taps: dict | None,
          forced: np.ndarray | None = None) -> np.ndarray:
    p = f"model.layers.{l}."
    x = rms_norm(h, W[p + "input_layernorm.weight"], cfg.rms_norm_eps)   # [T, D]
    _tap(taps, l, "attn_in", x)
    a = mla(cfg, W, l, x, cos, sin, cache, mask, absorbed, taps)         # [T, D]
    _tap(taps, l, "attn_out", a)
    h = h + a
    _tap(taps, l, "resid_attn", h)
    x = rms_norm(h, W[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
    _tap(taps, l, "mlp_in", x)
    if l < cfg.first_k_dense_replace:
        m = swiglu(W, p + "mlp.", x)                                     # dense MLP
    else:
        m = moe(cfg, W, l, x, taps, forced)
    _tap(taps, l, "mlp_out", m)
    h = h + m
    _tap(taps, l, "resid_out", h)
    return h


def forward(cfg: ModelConfig, W: dict, ids, positions, cache: KVCache | None = None, mask=None,
            absorbed: bool = False, taps: dict | None = None, cos_sin=None,
            forced_ids: dict | None = None) -> tuple[np.ndarray, list[np.ndarray]]:
    """Logits [T, V] and hiddens (L+1 arrays [T, D]: embeddings, then each layer's output) for T new tokens.
    Computes in the dtype of the weights: float64 is the oracle, float32 the same-precision baseline.

    cache: the new tokens' rows are appended to it. mask: None = causal over cache + new tokens; else an
    additive float [T, S_cache + T] (0 visible, -inf hidden). taps: a dict filled with "L{l}/{tap}",
    "final_hidden", "logits" (names and order in docs/golden-bundles.md). cos_sin: the RoPE tables
    [T, R/2] for `positions` when the caller computes them (an engine under test); default rope_cos_sin.
    forced_ids: {layer: [T, K]} expert ids to run instead of the router's choice (profiles.py measures
    arithmetic noise with it).
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    positions = np.asarray(positions, dtype=np.int64).reshape(-1)
    T, S_cache = ids.shape[0], 0 if cache is None else cache.length
    if T == 0 or positions.shape[0] != T:
        raise ValueError(f"forward: need T >= 1 ids and as many positions, got {T} ids, {positions.shape[0]} positions")
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(f"forward: token ids must be in [0, {cfg.vocab_size}), got {ids.min()}..{ids.max()}")
    if mask is None:
        mask = causal_mask(T, S_cache)                                   # [T, S]
    dtype = weights_dtype(W)                                             # float64 oracle or float32 engine
    mask = np.asarray(mask, dtype=dtype)
    if mask.shape != (T, S_cache + T):
        raise ValueError(f"forward: mask shape {mask.shape} must be [T, S_cache + T] = {(T, S_cache + T)}")
    cos, sin = rope_cos_sin(cfg, positions, dtype) if cos_sin is None else cos_sin   # [T, R/2] each
    h = embed_rows(W, ids)                                               # [T] -> [T, D]
    hiddens = [h]
    for l in range(cfg.num_hidden_layers):
        h = block(cfg, W, l, h, cos, sin, cache, mask, absorbed, taps, (forced_ids or {}).get(l))
        hiddens.append(h)
    x = rms_norm(h, W["model.norm.weight"], cfg.rms_norm_eps)            # [T, D]
    head = W["model.embed_tokens.weight"] if cfg.tie_word_embeddings else W["lm_head.weight"]
    logits = linear(x, head)                                             # [T, D] -> [T, V]
    if taps is not None:
        taps["final_hidden"] = x.copy()
        taps["logits"] = logits.copy()
    return logits, hiddens
