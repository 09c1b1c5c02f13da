"""The torch half of drafter distillation (refmodel/distill.py, docs/ddtree.md §2.4): the drafter in training
form and the training loop. Imported only inside the pinned-math worker (refmodel/pinned.py), after the corpus
helpers have been forked, so that torch's start-up overlaps the corpus; no other refmodel module imports torch.
Legend as in refmodel/distill.py.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from refmodel.drafter import DrafterConfig, drafter_shapes, init_drafter

# ----------------------------------------------------------------------------------------------------
# the matrix products: NumPy's OpenBLAS, not torch's MKL (docs/golden-bundles.md, "Regeneration on other CPUs")


class _NumpyMatmul(torch.autograd.Function):
    """a @ b in float32 by NumPy, forward and backward: under the pin (refmodel/pinned.py) NumPy's OpenBLAS
    on its Haswell kernels, one thread, the same code on every AVX2 CPU whatever its vendor. torch's own
    products go to MKL, which picks its code by vendor: an AMD EPYC and an Intel Xeon distilled different
    drafters through it under MKL's COMPATIBLE branch (bench/probe_distill_vendor.py measures both routes).
    Two shapes occur: [..., K] @ [K, O] (a weight; its gradient is one product over every leading row) and
    batched [B.., M, K] @ [B.., K, N] with the same batch dims (attention)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return torch.from_numpy(np.matmul(a.detach().numpy(), b.detach().numpy()))

    @staticmethod
    def backward(ctx, g):
        a, b = (t.detach().numpy() for t in ctx.saved_tensors)
        g = g.contiguous().numpy()
        ga = gb = None
        if ctx.needs_input_grad[0]:
            ga = torch.from_numpy(np.ascontiguousarray(np.matmul(g, np.swapaxes(b, -1, -2))))
        if ctx.needs_input_grad[1]:
            if b.ndim == 2:                               # a weight: every leading row summed in one product
                gb = np.matmul(a.reshape(-1, a.shape[-1]).T, g.reshape(-1, g.shape[-1]))
            else:
                gb = np.matmul(np.swapaxes(a, -1, -2), g)
            gb = torch.from_numpy(np.ascontiguousarray(gb))
        return ga, gb


def _mm(a, b):
    """a @ b for the drafter's training (_NumpyMatmul); b is a weight [K, O] or has a's batch dims."""
    if not (b.ndim == 2 or (a.ndim == b.ndim and a.shape[:-2] == b.shape[:-2])):
        raise ValueError(f"_mm: shapes {tuple(a.shape)} @ {tuple(b.shape)}: b must be [K, O] or share a's batch dims")
    return _NumpyMatmul.apply(a, b)

# ----------------------------------------------------------------------------------------------------
# the drafter in torch (training form: many blocks against one context, block-anchor mask)


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    """NeoX RoPE on x [..., S, heads, Dh] at positions pos [..., S] (same math as drafter.rope)."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64) / half)          # [Dh/2]
    ang = (pos.to(torch.float64)[..., None] * inv_freq).to(x.dtype)                 # [..., S, Dh/2]
    cos, sin = torch.cos(ang)[..., None, :], torch.sin(ang)[..., None, :]            # [..., S, 1, Dh/2]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def torch_drafter_logits(dcfg: DrafterConfig, P: dict, embed, head, feats, ids, anchors, ctx_from=None):
    """Logits [N, M, B-1, V] for blocks anchored at anchors [N, M] over sequences ids [N, T] with fused
    features feats [N, T, F]. Context keys ctx_from <= kv < a visible (ctx_from [N, M], default 0: the
    whole prefix, as at inference), bidirectional inside a block, blocks apart."""
    N, T = ids.shape
    M, B, eps, Dh = anchors.shape[1], dcfg.block_size, dcfg.rms_norm_eps, dcfg.head_dim
    off = torch.arange(B)
    blk_pos = (anchors[..., None] + off).reshape(N, M * B)                            # [N, Q]
    blk_ids = torch.full((N, M, B), dcfg.mask_token_id, dtype=torch.long)
    blk_ids[..., 0] = torch.gather(ids, 1, anchors)                                   # [N, M, B]
    ctx_pos = torch.arange(T).expand(N, T)                                            # [N, T]
    see_ctx = ctx_pos[:, None, :] < anchors.repeat_interleave(B, 1)[..., None]        # [N, Q, T]: kv < a
    if ctx_from is not None:
        see_ctx &= ctx_pos[:, None, :] >= ctx_from.repeat_interleave(B, 1)[..., None]
    blk_of = torch.arange(M).repeat_interleave(B)                                     # [Q]
    see_blk = (blk_of[:, None] == blk_of[None, :]).expand(N, M * B, M * B)
    bias = torch.zeros(N, M * B, T + M * B, dtype=feats.dtype)                        # [N, Q, T+Q]
    bias.masked_fill_(~torch.cat([see_ctx, see_blk], -1), float("-inf"))
    c = _rms(_mm(feats, P["drafter.fc.weight"].T), P["drafter.hidden_norm.weight"], eps)  # [N, T, D]
    h = embed[blk_ids]                                                                # [N, M, B, D]
    if dcfg.block_pos_embed:
        h = h + P["drafter.block_pos_embed"]                                          # + [B, D]
    h = h.reshape(N, M * B, -1)                                                       # [N, Q, D]
    for l in range(dcfg.num_hidden_layers):
        p = f"drafter.layers.{l}."
        x = _rms(h, P[p + "input_layernorm.weight"], eps)
        q = _mm(x, P[p + "self_attn.q_proj.weight"].T).unflatten(-1, (-1, Dh))          # [N, Q, H, Dh]
        q = _rope(_rms(q, P[p + "self_attn.q_norm.weight"], eps), blk_pos, dcfg.rope_theta)
        z = torch.cat([c, x], 1)                                                       # [N, T+Q, D]
        k = _mm(z, P[p + "self_attn.k_proj.weight"].T).unflatten(-1, (-1, Dh))          # [N, T+Q, G, Dh]
        k = _rope(_rms(k, P[p + "self_attn.k_norm.weight"], eps), torch.cat([ctx_pos, blk_pos], 1),
                  dcfg.rope_theta)
        v = _mm(z, P[p + "self_attn.v_proj.weight"].T).unflatten(-1, (-1, Dh))          # [N, T+Q, G, Dh]
        k = k.repeat_interleave(dcfg.num_key_value_groups, 2)                          # [N, T+Q, H, Dh]
        v = v.repeat_interleave(dcfg.num_key_value_groups, 2)
        s = _mm(q.permute(0, 2, 1, 3), k.permute(0, 2, 3, 1)) * Dh ** -0.5 + bias[:, None]   # [N, H, Q, T+Q]
        o = _mm(torch.softmax(s, -1), v.permute(0, 2, 1, 3)).permute(0, 2, 1, 3).flatten(-2)    # [N, Q, H*Dh]
        h = h + _mm(o, P[p + "self_attn.o_proj.weight"].T)
        x = _rms(h, P[p + "post_attention_layernorm.weight"], eps)
        g, u = _mm(x, P[p + "mlp.gate_proj.weight"].T), _mm(x, P[p + "mlp.up_proj.weight"].T)  # [N, Q, I]
        h = h + _mm(torch.nn.functional.silu(g) * u, P[p + "mlp.down_proj.weight"].T)
    out = _rms(h.reshape(N, M, B, -1)[:, :, 1:], P["drafter.norm.weight"], eps)       # [N, M, B-1, D]
    return _mm(out, head.T)                                                            # [N, M, B-1, V]


def block_anchor_loss(logits, ids, anchors, gamma: float, after_miss: float = 1.0, numpy_exp: bool = False):
    """Weighted CE of block row k against tok[a+k], k = 1..B-1, weight exp(-(k-1)/gamma), times `after_miss`
    where the drafter's own top-1 missed the stream at a row before k (1: every row counts alike). numpy_exp: the
    weights' exp by NumPy in float64, rounded to float32, not by torch (MKL's vector math; DistillSettings.
    vector_math)."""
    N, M, L, V = logits.shape
    k = torch.arange(1, L + 1)
    labels = torch.gather(ids, 1, (anchors[..., None] + k).reshape(N, M * L)).reshape(N, M, L)
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none")
    if numpy_exp:
        w = torch.from_numpy(np.exp(-(np.arange(L, dtype=np.float64)) / gamma).astype(np.float32))   # [L]
    else:
        w = torch.exp(-(k - 1).to(logits.dtype) / gamma)                              # [L]
    ce = ce.reshape(N, M, L) * w                                                      # [N, M, L]
    if after_miss != 1.0:
        hit = (logits.detach().argmax(-1) == labels).to(logits.dtype)                 # [N, M, L]
        ok = torch.cat([torch.ones(N, M, 1, dtype=hit.dtype), hit[..., :-1]], -1).cumprod(-1)   # rows 1..k-1 hit
        ce = ce * (ok + (1 - ok) * after_miss)
    return ce.sum() / (w.sum() * N * M)


# ----------------------------------------------------------------------------------------------------
# training

# MKL's vector math: torch's exp, log, tanh and sqrt of float32 CPU tensors go there, and their bits depend on MKL's
# branch (MKL_CBWR) on an Intel CPU and, as measured, on the vendor. Training uses two: the loss weights' exp and
# AdamW's square root. The pinned distillation of bench/probe_distill_vendor.py gave other weights under COMPATIBLE
# and AUTO on an Intel Xeon, with no MKL GEMM call, and other drafters than the AMD EPYC that made the committed
# bundles. DistillSettings.vector_math picks who computes both (docs/golden-bundles.md, "Measured on an Intel Xeon"):
# "numpy" (the default): NumPy, correctly rounded; the probe's digest was the same on that Intel Xeon under both
# branches and on an AMD EPYC. "torch": torch's own, as the bundles committed before stop 49 were distilled (kept to
# reproduce them, `kdtr gen --distill-math torch`; the same bits only on CPUs whose MKL takes the same path).


def _numpy_sqrt(v):
    """sqrt of a float32 CPU tensor by NumPy: correctly rounded, the same on every CPU (torch's goes to MKL)."""
    return torch.from_numpy(np.sqrt(v.numpy()))


class _AdamW:
    """torch.optim.AdamW's single-tensor step (defaults betas (0.9, 0.999), eps 1e-8; decoupled weight decay), the
    same operations in the same order on the same float32 tensors, with the square root of exp_avg_sq taken by
    `sqrt`: torch's own (torch.optim.AdamW's bits, tested; math "torch") or _numpy_sqrt (math "numpy"). `lr` is
    set per step."""

    def __init__(self, params, lr: float, weight_decay: float, sqrt=torch.sqrt, betas=(0.9, 0.999),
                 eps: float = 1e-8):
        self.params, self.lr, self.wd, (self.b1, self.b2), self.eps = list(params), lr, weight_decay, betas, eps
        self.sqrt = sqrt
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.t = 0.0

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1.0
        bc1, bc2 = 1 - self.b1 ** self.t, 1 - self.b2 ** self.t
        step_size, bc2_sqrt = self.lr / bc1, bc2 ** 0.5
        for p, m, v in zip(self.params, self.m, self.v):
            if p.grad is None:
                continue
            p.mul_(1 - self.lr * self.wd)
            m.lerp_(p.grad, 1 - self.b1)
            v.mul_(self.b2).addcmul_(p.grad, p.grad, value=1 - self.b2)
            denom = (self.sqrt(v) / bc2_sqrt).add_(self.eps)
            p.addcdiv_(m, denom, value=-step_size)


def _sample_anchors(gen, plens, T: int, B: int, M: int):
    """Anchors a in [P, T-B]: the block's labels lie in the continuation, never in the random prompt."""
    lo = torch.as_tensor(plens)[:, None]                                               # [N, 1]
    u = torch.rand(len(plens), M, generator=gen, dtype=torch.float64)                  # [N, M]
    return (lo + (u * (T - B + 1 - lo)).long()).clamp(max=T - B)


def train(cfg, W, dcfg, seed, s, ids_np, feats_np, plens, progress):
    """The drafter trained from init_drafter(dcfg, seed) on the corpus (ids [N, T], fused features [N, T, F],
    prompt lengths [N]) by settings s (refmodel.distill.DistillSettings); float64 numpy weights `drafter.*`.
    Call it where torch runs one thread with deterministic algorithms (refmodel.distill.distill_drafter)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    DW0 = init_drafter(dcfg, seed)
    P = {k: torch.tensor(v, dtype=torch.float32, requires_grad=True) for k, v in DW0.items()}
    embed = torch.tensor(W["model.embed_tokens.weight"], dtype=torch.float32)
    head = torch.tensor(W.get("lm_head.weight", W["model.embed_tokens.weight"]), dtype=torch.float32)
    ids, feats = torch.as_tensor(ids_np), torch.tensor(feats_np, dtype=torch.float32)
    nm = s.vector_math == "numpy"                              # checked by DistillSettings
    warm = max(1, s.steps // 20)
    schedule = lambda i: min(1.0, (i + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(i, s.steps) / s.steps))  # noqa: E731
    opt = _AdamW(P.values(), lr=s.lr, weight_decay=s.weight_decay, sqrt=_numpy_sqrt if nm else torch.sqrt)
    for step in range(s.steps):
        opt.lr = s.lr * schedule(step)                          # LambdaLR's lr: base lr times the schedule
        rows = torch.randperm(len(ids), generator=gen)[: s.batch]                       # [N]
        anchors = _sample_anchors(gen, plens[rows.numpy()], ids.shape[1], dcfg.block_size, s.anchors)
        wmax = anchors.clamp(max=s.window_max) if s.window_max > 0 else anchors
        w = 1 + (torch.rand(anchors.shape, generator=gen, dtype=torch.float64) * wmax).long()      # [N, M]
        u = torch.rand(anchors.shape, generator=gen, dtype=torch.float64)
        ctx_from = torch.where(u < s.window_prob, anchors - w, torch.zeros_like(anchors))
        ctx_from = torch.where(u >= 1 - s.empty_prob, anchors, ctx_from)                 # empty context
        logits = torch_drafter_logits(dcfg, P, embed, head, feats[rows], ids[rows], anchors, ctx_from)
        ramp = min(1.0, step / max(1.0, s.ramp_frac * s.steps))
        loss = block_anchor_loss(logits, ids[rows], anchors, s.gamma_start + ramp * (s.gamma - s.gamma_start),
                                 s.after_miss, numpy_exp=nm)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(P.values(), 1.0)
        opt.step()
        if progress:
            progress("train", step + 1, s.steps, loss.item())
    assert set(P) == set(drafter_shapes(dcfg))
    return {k: v.detach().to(torch.float64).numpy().copy() for k, v in P.items()}
