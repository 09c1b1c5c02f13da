"""User modules for `--engine torch --module`: ports of transformers' DeepseekV3, some with a planted bug.

`PortForCausalLM` is a faithful port (it must pass). `BiasFreeRouterForCausalLM` routes by the sigmoid
scores alone, ignoring the `e_score_correction_bias` it loads (a router ported from a softmax/aux-loss
model), and `BiasOnLogitsRouterForCausalLM` adds the bias to the gate's logits instead of the sigmoid
scores (the same order of experts only where the sigmoid is near-linear): routing bugs that held
routing must not hide. `KRopeBugForCausalLM` rotates k's RoPE dims in
(i, i + R/2) pairs, as if they were already de-interleaved, while q keeps the checkpoint's interleaved
pairs (2i, 2i + 1): a port that fixed the layout on one side only. Everything before the rotated key
(attn_in, q, kv_latent) is right, so the first divergence must be layer 0's `k_pe`.

`InterleavedPortForCausalLM` is correct but keeps the checkpoint's interleaved RoPE pairs (2i, 2i + 1)
instead of transformers' de-interleaved layout, and declares so (`kdtr_rope_layout`); its undeclared twin
is judged in transformers' layout. `TupleOutputForCausalLM` returns a tuple instead of an output object;
`NoRotaryForCausalLM` has no `model.rotary_emb` (its attention makes its own tables), so it runs, but
run_layer cannot.

`Float64RopePortForCausalLM` is the interleaved port with RoPE angles formed in float64: correct on every
prompt, the long-position one included. `PackedInt4PortForCausalLM` is that port doing also the two steps kdtr otherwise performs for a port: it decodes
the INT4 experts itself (`kdtr_int4_packed = True`: it receives weight_packed / weight_scale / weight_shape)
and compacts its own cache (`kdtr_cache_class` with `compact`). `ReversedNibblesForCausalLM` reads the
nibbles of each packed word in reverse order, `StartlessCompactionForCausalLM` compacts to rows `keep`
instead of `start + keep`.
"""
import math

import torch
from transformers import DeepseekV3ForCausalLM, DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3Attention, DeepseekV3MoE,
                                                                  DeepseekV3TopkRouter, apply_rotary_pos_emb,
                                                                  apply_rotary_pos_emb_interleave,
                                                                  eager_attention_forward)


def rotate_interleaved(x, cos, sin):
    """Rotate the checkpoint's pairs (2i, 2i + 1) of x [B, h, T, R] in place; transformers' cos/sin
    [B, T, R] hold each pair's angle twice (cat(freqs, freqs)), so their first half is per pair."""
    c, s = cos[..., : x.shape[-1] // 2].unsqueeze(1), sin[..., : x.shape[-1] // 2].unsqueeze(1)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2)


class PortAttention(DeepseekV3Attention):
    """transformers' MLA forward, as a user would port it; the class flags plant the bugs."""
    k_rope_bug = False          # rotate k's rope dims in (i, i + R/2) pairs (q stays interleaved)
    own_attention = False       # call eager attention directly, not through transformers' interface
    interleaved = False         # keep the checkpoint's RoPE layout (pairs 2i, 2i + 1): correct too

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        B, T = hidden_states.shape[:-1]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(B, T, -1, self.qk_head_dim).transpose(1, 2)                 # [B, H, T, A]
        q_pass, q_rot = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_a_proj_with_mqa(hidden_states)
        kv_nope, k_rot = torch.split(kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_nope = self.kv_a_layernorm(kv_nope).view(B, 1, T, self.kv_lora_rank)
        k_rot = k_rot.view(B, 1, T, self.qk_rope_head_dim)
        cos, sin = position_embeddings
        if self.interleaved:
            q_rot, k_rot = rotate_interleaved(q_rot, cos, sin), rotate_interleaved(k_rot, cos, sin)
        elif self.k_rope_bug:
            q_rot, _ = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)  # right on q
            _, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin)             # THE BUG: rotate-half on k
        else:
            q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
        if cache is not None:
            kv_nope, k_rot = cache.update(kv_nope, k_rot, self.layer_idx)
        key, value = self.expand_kv(kv_nope, k_rot)
        attention = eager_attention_forward if self.own_attention else ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward)
        out, _ = attention(self, torch.cat((q_pass, q_rot), dim=-1), key, value, attention_mask,
                           dropout=0.0, scaling=self.scaling)
        return self.o_proj(out.reshape(B, T, -1).contiguous()), None


class PortForCausalLM(DeepseekV3ForCausalLM):
    attention = PortAttention

    def __init__(self, config):
        super().__init__(config)
        for l, layer in enumerate(self.model.layers):
            layer.self_attn = self.attention(config, l)


class BiasFreeRouter(DeepseekV3TopkRouter):
    """THE BUG: experts chosen by top-K of the sigmoid scores, without the correction bias (one group, as
    the tiny model has); the weights are gathered, normalised and scaled as transformers does."""

    def choice(self, logits, scores):
        return scores                                                           # no bias

    def forward(self, hidden_states):
        logits = torch.nn.functional.linear(hidden_states.view(-1, self.hidden_dim).float(), self.weight.float())
        scores = logits.sigmoid()                                               # [T, E]
        ids = torch.topk(self.choice(logits, scores), k=self.top_k, dim=-1, sorted=False)[1]   # [T, K]
        w = scores.gather(1, ids)
        if self.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, w * self.routed_scaling_factor, ids


class BiasOnLogitsRouter(BiasFreeRouter):
    """THE BUG: the correction bias added to the gate's logits, not to the sigmoid scores."""

    def choice(self, logits, scores):
        return logits + self.e_score_correction_bias


class BiasFreeRouterForCausalLM(PortForCausalLM):
    router = BiasFreeRouter

    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            if isinstance(layer.mlp, DeepseekV3MoE):
                layer.mlp.gate = self.router(config)


class BiasOnLogitsRouterForCausalLM(BiasFreeRouterForCausalLM):
    router = BiasOnLogitsRouter


class KRopeBugForCausalLM(PortForCausalLM):
    attention = type("KRopeBugAttention", (PortAttention,), {"k_rope_bug": True})


class OwnAttentionForCausalLM(PortForCausalLM):
    """Correct, but its attention bypasses transformers' interface: the rotated query is not observable."""
    attention = type("OwnAttention", (PortAttention,), {"own_attention": True})


class RenamedForCausalLM(torch.nn.Module):
    """A module whose parameters do not carry the HF names: the engine must refuse it clearly."""

    def __init__(self, config):
        super().__init__()
        self.embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)


class InterleavedPortForCausalLM(PortForCausalLM):
    kdtr_rope_layout = "interleaved"
    attention = type("InterleavedAttention", (PortAttention,), {"interleaved": True})


class UndeclaredInterleavedPortForCausalLM(PortForCausalLM):
    attention = InterleavedPortForCausalLM.attention


class TupleOutputForCausalLM(PortForCausalLM):
    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs).to_tuple()


class NoRotaryForCausalLM(PortForCausalLM):
    """Correct, but its rotary embedding is its attention's own: model.rotary_emb does not exist."""

    def __init__(self, config):
        super().__init__(config)
        self.model.own_rotary = self.model.rotary_emb
        del self.model.rotary_emb

    def forward(self, input_ids, position_ids, **kwargs):
        self.model.rotary_emb = self.model.own_rotary                   # for this forward only
        try:
            return super().forward(input_ids=input_ids, position_ids=position_ids, **kwargs)
        finally:
            del self.model.rotary_emb


# ---------------------------------------------------------------- ports that decode INT4 and compact their cache

class PackedLinear(torch.nn.Module):
    """A compressed-tensors INT4 linear (docs/int4.md), decoded in the forward: weight_packed int32 [N, K/8]
    (column 8j + i in bits 4i .. 4i + 3 of word j, offset by 8), weight_scale bfloat16 [N, K/32]."""
    reversed_nibbles = False    # THE BUG, when set: column 8j + i read from bits 4(7 - i) ..

    def __init__(self, in_features: int, out_features: int, group_size: int = 32):
        super().__init__()
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 8, dtype=torch.int32))
        self.register_buffer("weight_scale", torch.zeros(out_features, in_features // group_size, dtype=torch.bfloat16))
        self.register_buffer("weight_shape", torch.tensor([out_features, in_features]))

    def dense(self) -> torch.Tensor:
        N, K = (int(x) for x in self.weight_shape)
        shifts = 4 * torch.arange(8, dtype=torch.int32, device=self.weight_packed.device)
        if self.reversed_nibbles:
            shifts = shifts.flip(0)
        u = (self.weight_packed[..., None] >> shifts) & 0xF                     # [N, K/8, 8]
        q = u.reshape(N, K).float() - 8.0                                       # [N, K] codes
        sc = self.weight_scale.float().repeat_interleave(K // self.weight_scale.shape[1], dim=1)
        return q * sc                                                           # exact in float32

    def forward(self, x):
        return torch.nn.functional.linear(x, self.dense().to(x.dtype))


class PackedExperts(torch.nn.ModuleList):
    """The routed experts, one module per expert (mlp.experts.{e}.gate_proj ...), each linear INT4 as stored;
    called as transformers' experts are: (hidden [T, D], topk_ids [T, K], topk_weights [T, K]) -> [T, D]."""
    linear = PackedLinear

    def __init__(self, config):
        D, I = config.hidden_size, config.moe_intermediate_size
        super().__init__(torch.nn.ModuleDict(
            {"gate_proj": self.linear(D, I), "up_proj": self.linear(D, I), "down_proj": self.linear(I, D)})
            for _ in range(config.n_routed_experts))

    def forward(self, hidden, topk_ids, topk_weights):
        out = torch.zeros_like(hidden)
        for e, ex in enumerate(self):
            rows, slot = torch.nonzero(topk_ids == e, as_tuple=True)
            if rows.numel():
                x = hidden[rows]
                y = ex["down_proj"](torch.nn.functional.silu(ex["gate_proj"](x)) * ex["up_proj"](x))
                out.index_add_(0, rows, y * topk_weights[rows, slot, None].to(y.dtype))
        return out


class CompactingCache(DynamicCache):
    """transformers' cache with its own DDTree compaction (docs/engine-api.md, "The cache")."""

    def rows(self, start: int, keep: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.arange(start, device=keep.device), start + keep])

    def compact(self, start: int, keep: torch.Tensor) -> None:
        rows = self.rows(start, keep)
        for layer in self.layers:
            layer.keys, layer.values = layer.keys[:, :, rows], layer.values[:, :, rows]


class StartlessCompactingCache(CompactingCache):
    """THE BUG: keep is taken as absolute rows, not relative to `start`."""

    def rows(self, start: int, keep: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.arange(start, device=keep.device), keep])


class Float64Rotary(torch.nn.Module):
    """RoPE tables from angles formed in float64 (docs/model.md: positions up to 2^18 need it), cos and sin
    then cast: DeepSeek's YaRN inverse frequencies, as transformers' DeepseekV3RotaryEmbedding returns them."""

    def __init__(self, config, scaling: float):
        super().__init__()
        rope, R = config.rope_parameters, config.qk_rope_head_dim
        theta = rope["rope_theta"]
        inv = 1.0 / theta ** (torch.arange(0, R, 2, dtype=torch.float64) / R)             # [R/2]
        if rope.get("rope_type") == "yarn":
            dim = lambda rot: R * math.log(rope["original_max_position_embeddings"] / (rot * 2 * math.pi)) / (  # noqa: E731
                2 * math.log(theta))
            low, high = max(math.floor(dim(rope["beta_fast"])), 0.0), min(math.ceil(dim(rope["beta_slow"])), R - 1.0)
            ramp = ((torch.arange(R // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
            inv = inv * (1 - ramp) + inv / rope["factor"] * ramp
        self.inv_freq64, self.scaling = inv, scaling

    def forward(self, x, position_ids):
        angle = position_ids.double()[..., None] * self.inv_freq64                         # [B, T, R/2]
        angle = torch.cat([angle, angle], dim=-1)                                          # transformers' layout
        return ((angle.cos() * self.scaling).to(x.dtype), (angle.sin() * self.scaling).to(x.dtype))


class Float64RopePortForCausalLM(InterleavedPortForCausalLM):
    """Correct throughout, the long-position prompt included: interleaved RoPE from float64 angles. INT4
    experts and cache compaction are left to kdtr."""

    def __init__(self, config):
        super().__init__(config)
        self.model.rotary_emb = Float64Rotary(config, self.model.rotary_emb.attention_scaling)


class PackedInt4PortForCausalLM(Float64RopePortForCausalLM):
    """Correct, and doing itself what kdtr otherwise does for a port: INT4 decode and cache compaction."""
    kdtr_int4_packed = True
    kdtr_cache_class = CompactingCache
    experts = PackedExperts

    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            if isinstance(layer.mlp, DeepseekV3MoE):
                layer.mlp.experts = self.experts(config)


class ReversedNibblesForCausalLM(PackedInt4PortForCausalLM):
    experts = type("ReversedNibblesExperts", (PackedExperts,),
                   {"linear": type("ReversedNibbles", (PackedLinear,), {"reversed_nibbles": True})})


class StartlessCompactionForCausalLM(PackedInt4PortForCausalLM):
    kdtr_cache_class = StartlessCompactingCache
