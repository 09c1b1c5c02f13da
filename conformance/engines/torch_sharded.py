"""One rank of kdtr's sharded PyTorch DeepseekV3: tensor- and expert-parallel over torch.distributed.

Each rank is its own process (conformance/verify/shard_run.py starts them, gloo on the CPU) and holds only its
shard of the weights (conformance/shard_plan.py, ShardPlan):

    attention, tp = W   heads [lo, hi) of q_b_proj, kv_b_proj (rows) and o_proj (columns); o_proj's partial
                        sums are all-reduced; q_a, kv_a and the norms are replicated, so the KV cache
                        (kv_latent, k_pe) is too
    dense MLP, tp = W   intermediate columns [lo, hi) of gate/up, rows of down; all-reduced
    MoE, ep = W         the gate's rows of this rank's experts (router_scores: its experts' columns, then
                        all-gathered); every rank routes all tokens the same way; each rank owns the rows
                        rows_of(T) gives it, sends their (token, expert) pairs to the experts' ranks
                        (all-to-all), computes the pairs it receives, sends the outputs back (all-to-all),
                        combines its rows and adds the shared expert: mlp_out holds its rows; all-gathered
    MoE, tp = W, ep = 1 every expert's and the shared expert's intermediate columns [lo, hi); all-reduced
    lm_head             vocabulary rows [lo, hi); the logits are all-gathered, so every rank's are the same

The arithmetic is refmodel's (the float32 reference engine's) in torch: RoPE tables formed in float64 and
rounded, the router's selection by refmodel.model.select_experts. Planted sharding faults for the tests
(`fault`, one at a time): `no_allreduce` (layer: o_proj's partials never summed), `head_stride` (rank: its
heads taken with stride tp, while it still says contiguous), `expert_wrong_rank` (layer, expert: that
expert's pairs sent to the next rank, which runs its own expert of the same local index),
`combine_twice` (layer, rank: the owner adds the outputs that came back from the next rank twice),
`shared_every_rank` (layer; tp = W, ep = 1: the whole shared expert on every rank, then summed).

Legend: T tokens, S cache rows, D hidden, H heads (Hl this rank's), A = N + R, N nope dims, R rope dims,
C kv_lora_rank, U v_head_dim, E experts (El this rank's), K top-k, I width (Il this rank's), V vocab.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from refmodel.stored import read_model
from conformance.engines.protocol import compact_keep
from conformance.shard_plan import ShardFault, ShardPlan, rows_of
from refmodel.model import causal_mask, expert_weights, rope_cos_sin, select_experts, tap_names

def _t(a) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x / torch.sqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps))


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    g, u = x @ gate.T, x @ up.T                                          # [T, D] -> [T, I]
    return (g / (1.0 + torch.exp(-g)) * u) @ down.T                      # [T, I] -> [T, D]


def experts_swiglu(x: torch.Tensor, coef: torch.Tensor, experts: tuple) -> torch.Tensor:
    """sum over experts e of coef[p, e] * expert_e(x[p]) for the rows of x [P, D]; `experts`: (gate, up,
    down), each [E, I, D] (down transposed), the experts side by side. Three matmuls over every expert,
    the products of the experts a row does not use scaled by an exact 0 before the down projection (so
    they add nothing), instead of a loop over experts."""
    gate, up, down = experts
    E, I, D = gate.shape
    g = (x @ gate.reshape(E * I, D).T).reshape(-1, E, I)                # [P, D] -> [P, E, I]
    u = (x @ up.reshape(E * I, D).T).reshape(-1, E, I)
    h = g / (1.0 + torch.exp(-g)) * u * coef[:, :, None]                # [P, E, I]
    return h.reshape(-1, E * I) @ down.reshape(E * I, D)                # [P, D]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs (2i, 2i+1) rotated by angle i, as refmodel.model.apply_rope. x: [T, .., R]."""
    shape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (cos.shape[1],)
    c, s = cos.reshape(shape), sin.reshape(shape)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2)   # [T, .., R/2, 2] -> [T, .., R]


class RankEngine:
    """The Engine protocol (conformance/engines/protocol.py) as one rank runs it: every call is collective, so all
    ranks make the same calls in the same order (they do: each drives the same bundle through
    conformance.verify.collect, and the logits every decision reads are all-gathered, the same on every rank).
    Taps are this rank's records: its shard of a split tap (ShardPlan.records), its copy of the rest."""
    name = "torch"
    dtype = "float32"
    supports_teacher_forcing = False

    def __init__(self, plan: ShardPlan, rank: int, fault: ShardFault | None = None):
        self.plan, self.rank, self.W, self.fault = plan, rank, plan.world_size, fault
        self._held: dict = {}
        self.held_rows = 0

    # -- weights

    def load(self, f) -> None:
        cfg, W = read_model(f, np.float32)
        self.plan.check(cfg)
        self.cfg = cfg
        r, fault = self.rank, self.fault
        H, A, U = cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim
        lo, hi = self.plan.heads(cfg, r)
        heads = np.arange(lo, hi)
        if fault and fault.name == "head_stride" and fault.rank == r:
            heads = np.arange(r, H, self.plan.tp)                        # the bug: strided, said contiguous
        self.layers = []
        for l in range(cfg.num_hidden_layers):
            p = f"model.layers.{l}."
            a = f"{p}self_attn."
            L = {"in_ln": _t(W[p + "input_layernorm.weight"]), "post_ln": _t(W[p + "post_attention_layernorm.weight"]),
                 "q_a": _t(W[a + "q_a_proj.weight"]), "q_a_ln": _t(W[a + "q_a_layernorm.weight"]),
                 "q_b": _t(W[a + "q_b_proj.weight"].reshape(H, A, -1)[heads].reshape(len(heads) * A, -1)),
                 "kv_a": _t(W[a + "kv_a_proj_with_mqa.weight"]), "kv_a_ln": _t(W[a + "kv_a_layernorm.weight"]),
                 "kv_b": _t(W[a + "kv_b_proj.weight"].reshape(H, -1, cfg.kv_lora_rank)[heads]
                            .reshape(-1, cfg.kv_lora_rank)),
                 "o": _t(W[a + "o_proj.weight"].reshape(-1, H, U)[:, heads].reshape(cfg.hidden_size, -1))}
            if l < cfg.first_k_dense_replace:
                L["mlp"] = self._mlp(W, p + "mlp.", cfg.intermediate_size, split=self.plan.tp > 1)
            else:
                L.update(self._moe_weights(W, l))
            self.layers.append(L)
        V = cfg.vocab_size // self.W
        head = W["model.embed_tokens.weight"] if cfg.tie_word_embeddings else W["lm_head.weight"]
        self.embed, self.norm = _t(W["model.embed_tokens.weight"]), _t(W["model.norm.weight"])
        self.lm_head = _t(head[r * V:(r + 1) * V])
        self.reset()

    def _mlp(self, W, p: str, width: int, split: bool) -> tuple:
        """(gate, up, down) of a SwiGLU MLP: whole, or this rank's intermediate columns (split)."""
        n = width // self.W if split else width
        lo = self.rank * n if split else 0
        return (_t(W[p + "gate_proj.weight"][lo:lo + n]), _t(W[p + "up_proj.weight"][lo:lo + n]),
                _t(W[p + "down_proj.weight"][:, lo:lo + n]))

    @staticmethod
    def _stacked(mlps: list) -> tuple:
        """Experts' (gate [I, D], up [I, D], down [D, I]) as experts_swiglu takes them: three [E, I, D]."""
        return tuple(torch.stack(m).contiguous() for m in ([g for g, _, _ in mlps], [u for _, u, _ in mlps],
                                                           [d.T for _, _, d in mlps]))

    def _moe_weights(self, W, l: int) -> dict:
        cfg, p = self.cfg, f"model.layers.{l}.mlp."
        lo, hi = self.plan.experts(cfg, self.rank)
        tp_moe = self.plan.tp > 1 and self.plan.ep == 1
        full_shared = not tp_moe or (self.fault is not None and self.fault.at("shared_every_rank", l))
        I = cfg.moe_intermediate_size
        return {"gate": _t(W[p + "gate.weight"][lo:hi] if self.plan.ep > 1 else W[p + "gate.weight"]),
                "bias": np.asarray(W[p + "gate.e_score_correction_bias"], np.float32),
                "experts": self._stacked([self._mlp(W, p + f"experts.{e}.", I, tp_moe) for e in range(lo, hi)]),
                "shared": (self._mlp(W, p + "shared_experts.", I * cfg.n_shared_experts, not full_shared)
                           if cfg.n_shared_experts else None)}

    # -- collectives

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.W > 1:
            dist.all_reduce(x)
        return x

    def _all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if self.W == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.W)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)

    def _all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = torch.empty((sum(recv),) + tuple(x.shape[1:]), dtype=x.dtype)
        dist.all_to_all_single(out, x.contiguous(), recv, send)
        return out

    # -- the model

    def _attention(self, l: int, L: dict, x, cos, sin, mask, taps) -> torch.Tensor:
        cfg, T = self.cfg, x.shape[0]
        N, R, C, U = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
        c_q = rms_norm(x @ L["q_a"].T, L["q_a_ln"], cfg.latent_norm_eps)            # [T, Q]
        q = (c_q @ L["q_b"].T).reshape(T, -1, cfg.qk_head_dim)                       # [T, Hl, A]
        q_nope, q_pe = q[..., :N], apply_rope(q[..., N:], cos, sin)                  # [T, Hl, N], [T, Hl, R]
        kv = x @ L["kv_a"].T                                                         # [T, C + R]
        c_kv = rms_norm(kv[:, :C], L["kv_a_ln"], cfg.latent_norm_eps)                # [T, C]
        k_pe = apply_rope(kv[:, C:], cos, sin)                                       # [T, R]
        taps[f"L{l}/q"] = torch.cat([q_nope, q_pe], dim=-1)
        taps[f"L{l}/kv_latent"], taps[f"L{l}/k_pe"] = c_kv, k_pe
        self.c_kv[l] = torch.cat([self.c_kv[l], c_kv])                               # [S, C]
        self.k_pe[l] = torch.cat([self.k_pe[l], k_pe])                               # [S, R]
        kvb = (self.c_kv[l] @ L["kv_b"].T).reshape(self.c_kv[l].shape[0], -1, N + U)  # [S, Hl, N+U]
        scores = (torch.einsum("thn,shn->hts", q_nope, kvb[..., :N])
                  + torch.einsum("thr,sr->hts", q_pe, self.k_pe[l]))                 # [Hl, T, S]
        probs = torch.softmax(scores * cfg.softmax_scale + mask, dim=-1)
        o = torch.einsum("hts,shu->thu", probs, kvb[..., N:]).reshape(T, -1)         # [T, Hl U]
        part = o @ L["o"].T                                                          # [T, D], this rank's heads
        if self.plan.tp > 1 and not (self.fault and self.fault.at("no_allreduce", l)):
            self._all_reduce(part)
        return part

    def _route(self, l: int, L: dict, x, taps):
        """(ids [T, K] the experts run, weights [T, K]) from the whole router, this rank's columns tapped."""
        cfg = self.cfg
        local = torch.sigmoid(x @ L["gate"].T)                                       # [T, El] or [T, E]
        taps[f"L{l}/router_scores"] = local
        scores = (self._all_gather(local, -1) if self.plan.ep > 1 else local).numpy()   # [T, E]
        own = select_experts(cfg, scores + L["bias"])                               # [T, K]
        ids, held = own, self._held.get(l)
        if held is not None:
            held = np.asarray(held, np.int64)
            run = ~(held < 0).all(-1)
            ids = np.where(run[:, None], held, own)
            self.held_rows += int(np.sum(run & (np.sort(held, -1) != np.sort(own, -1)).any(-1)))
        weights = expert_weights(cfg, scores, ids)                                   # [T, K] from own scores
        taps[f"L{l}/topk_ids"] = torch.from_numpy(np.asarray(own, np.int64))
        taps[f"L{l}/topk_weights"] = torch.from_numpy(np.asarray(weights, np.float32))     # of the experts run
        return ids, torch.from_numpy(np.ascontiguousarray(weights, np.float32))

    def _moe_tp(self, l: int, L: dict, x, ids, w) -> torch.Tensor:
        """Every expert's intermediate columns here; the partial sums all-reduced."""
        coef = torch.zeros((x.shape[0], self.cfg.n_routed_experts)).scatter_(
            1, torch.from_numpy(np.ascontiguousarray(ids)), w)                   # [T, E]: 0 off the top-k
        y = experts_swiglu(x, coef, L["experts"])                            # this rank's columns only
        if L["shared"] is not None:
            y = y + swiglu(x, *L["shared"])
        return self._all_reduce(y)

    def _moe_ep(self, l: int, L: dict, x, ids, w, taps) -> torch.Tensor:
        """Dispatch this rank's rows' (token, expert) pairs to the experts' ranks, run the pairs received,
        send the outputs back, combine this rank's rows; then all-gather the rows."""
        cfg, r, W, fault = self.cfg, self.rank, self.W, self.fault
        El = cfg.n_routed_experts // W
        lo, hi = rows_of(x.shape[0], W, r)
        tok, slot = np.nonzero(np.ones_like(ids[lo:hi], bool))                      # this rank's pairs
        tok = tok + lo
        e = ids[tok, slot]
        dest = e // El
        if fault and fault.at("expert_wrong_rank", l):
            dest = np.where(e == fault.expert, (dest + 1) % W, dest)               # the bug: the wrong rank
        order = np.argsort(dest, kind="stable")
        tok, slot, e, dest = tok[order], slot[order], e[order], dest[order]
        t_tok, t_slot = torch.from_numpy(tok), torch.from_numpy(slot)
        send = np.bincount(dest, minlength=W).tolist()
        recv = self._all_to_all(torch.tensor(send, dtype=torch.int64), [1] * W, [1] * W).tolist()
        x_in = self._all_to_all(x[t_tok], send, recv)                                  # [pairs in, D]
        e_in = self._all_to_all(torch.from_numpy(e % El), send, recv).numpy()        # local expert index
        one = torch.nn.functional.one_hot(torch.from_numpy(e_in), El).to(x.dtype)   # [pairs in, El]
        y_in = experts_swiglu(x_in, one, L["experts"])                           # [pairs in, D]
        y_back = self._all_to_all(y_in, recv, send)                                  # [pairs out, D]
        out = torch.zeros((hi - lo, x.shape[1]))
        gain = torch.ones(len(tok))
        if fault and fault.at("combine_twice", l) and fault.rank == r:
            gain[torch.from_numpy(dest == (r + 1) % W)] = 2.0                        # the bug: one rank twice
        out.index_add_(0, t_tok - lo, (w[t_tok, t_slot] * gain)[:, None] * y_back)
        if L["shared"] is not None:
            out = out + swiglu(x[lo:hi], *L["shared"])
        taps[f"L{l}/mlp_out"] = out
        n = -(-x.shape[0] // W)                                                      # rows per rank, padded
        padded = torch.zeros((n, x.shape[1]))
        padded[:hi - lo] = out
        parts = self._all_gather(padded, 0).reshape(W, n, -1)
        return torch.cat([parts[q, :rows_of(x.shape[0], W, q)[1] - rows_of(x.shape[0], W, q)[0]] for q in range(W)])

    def _block(self, l: int, h, cos, sin, mask, taps) -> torch.Tensor:
        cfg, L = self.cfg, self.layers[l]
        x = rms_norm(h, L["in_ln"], cfg.rms_norm_eps)
        taps[f"L{l}/attn_in"] = x
        a = self._attention(l, L, x, cos, sin, mask, taps)
        taps[f"L{l}/attn_out"] = a
        h = h + a
        taps[f"L{l}/resid_attn"] = h
        x = rms_norm(h, L["post_ln"], cfg.rms_norm_eps)
        taps[f"L{l}/mlp_in"] = x
        if l < cfg.first_k_dense_replace:
            m = self._all_reduce(swiglu(x, *L["mlp"])) if self.plan.tp > 1 else swiglu(x, *L["mlp"])
        else:
            ids, w = self._route(l, L, x, taps)
            m = self._moe_ep(l, L, x, ids, w, taps) if self.plan.ep > 1 else self._moe_tp(l, L, x, ids, w)
        taps.setdefault(f"L{l}/mlp_out", m)
        h = h + m
        taps[f"L{l}/resid_out"] = h
        return h

    def _forward(self, ids, positions, mask) -> tuple[np.ndarray, dict]:
        ids = np.array(ids, np.int64).reshape(-1)                            # a writable copy for torch
        T, S = len(ids), self.c_kv[0].shape[0]
        mask = torch.from_numpy(np.asarray(causal_mask(T, S) if mask is None else mask, np.float32))   # [T, S+T]
        cos, sin = (torch.from_numpy(t) for t in rope_cos_sin(self.cfg, np.asarray(positions, np.int64), np.float32))
        taps: dict = {}
        try:
            with torch.no_grad():
                h = self.embed[torch.from_numpy(ids)]                                # [T, D]
                for l in range(self.cfg.num_hidden_layers):
                    h = self._block(l, h, cos, sin, mask, taps)
                x = rms_norm(h, self.norm, self.cfg.rms_norm_eps)
                taps["final_hidden"] = x
                logits = self._all_gather(x @ self.lm_head.T, -1)                    # [T, V]
        finally:
            self._held = {}
        order = [f"L{l}/{t}" for l in range(self.cfg.num_hidden_layers) for t in tap_names(self.cfg, l)]
        out = {k: taps[k].numpy().copy() for k in order + ["final_hidden"]}
        out["logits"] = logits.numpy().copy()
        return out["logits"], out

    # -- the protocol

    def reset(self) -> None:
        C, R = self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim
        self.c_kv = [torch.zeros((0, C)) for _ in range(self.cfg.num_hidden_layers)]
        self.k_pe = [torch.zeros((0, R)) for _ in range(self.cfg.num_hidden_layers)]

    def hold_routing(self, ids: dict | None) -> None:
        self._held = dict(ids or {})

    def prefill(self, ids, positions):
        return self._forward(ids, positions, None)

    def decode(self, token, position):
        return self._forward([token], [position], None)

    def verify_tree(self, ids, positions, mask):
        return self._forward(ids, positions, mask)

    def compact(self, start, keep) -> None:
        keep = compact_keep(start, keep, self.c_kv[0].shape[0])
        rows = torch.from_numpy(np.concatenate([np.arange(start), start + keep]))
        self.c_kv = [c[rows] for c in self.c_kv]
        self.k_pe = [k[rows] for k in self.k_pe]
