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
"""
import torch
from transformers import DeepseekV3ForCausalLM
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
