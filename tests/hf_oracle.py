"""Build transformers' DeepseekV3ForCausalLM from our ModelConfig + weights: the independent oracle (tests only).

Traps handled (docs/model.md §7): n_group/topk_group always set; max_position_embeddings = factor x original (some
transformers revisions recompute factor from it); mscale and mscale_all_dim passed through; rope_interleave left
at its default (True); experts written straight into the fused v5 params (load_state_dict with per-expert names
silently skips them); experts_implementation="eager" so the model can run in float64.
"""
from __future__ import annotations

import numpy as np
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from refmodel.config import ModelConfig


def hf_config(cfg: ModelConfig) -> DeepseekV3Config:
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    max_pos = cfg.max_position_embeddings
    if cfg.rope_scaling is not None:
        rope = {k: v for k, v in cfg.rope_scaling.items() if k != "type"}
        rope.update(rope_type="yarn", rope_theta=cfg.rope_theta)
        max_pos = int(round(rope["factor"] * rope["original_max_position_embeddings"]))
    return DeepseekV3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_attention_heads,
        n_shared_experts=cfg.n_shared_experts, n_routed_experts=cfg.n_routed_experts,
        routed_scaling_factor=cfg.routed_scaling_factor, kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim, n_group=cfg.n_group, topk_group=cfg.topk_group,
        num_experts_per_tok=cfg.num_experts_per_tok, first_k_dense_replace=cfg.first_k_dense_replace,
        norm_topk_prob=cfg.norm_topk_prob, max_position_embeddings=max_pos, rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters=rope, tie_word_embeddings=cfg.tie_word_embeddings, num_mtp_layers=0,
    )


def hf_model(cfg: ModelConfig, W: dict[str, np.ndarray], dtype=torch.float32) -> DeepseekV3ForCausalLM:
    """An eval-mode DeepseekV3ForCausalLM holding exactly W (per-expert tensors fused as transformers v5 wants)."""
    model = DeepseekV3ForCausalLM._from_config(hf_config(cfg), attn_implementation="eager",
                                               experts_implementation="eager").to(dtype).eval()
    state = {}
    for name, arr in W.items():
        if ".mlp.experts." not in name:
            state[name] = torch.from_numpy(np.ascontiguousarray(arr))
    for l in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        p = f"model.layers.{l}.mlp.experts."
        E = range(cfg.n_routed_experts)
        gate_up = [np.concatenate([W[p + f"{e}.gate_proj.weight"], W[p + f"{e}.up_proj.weight"]]) for e in E]
        state[p + "gate_up_proj"] = torch.from_numpy(np.stack(gate_up))                      # [E, 2I, D]
        state[p + "down_proj"] = torch.from_numpy(np.stack([W[p + f"{e}.down_proj.weight"] for e in E]))  # [E, D, I]
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    assert not missing and not unexpected, f"HF names differ: missing {missing[:5]}, unexpected {unexpected[:5]}"
    with torch.no_grad():
        for name, tensor in state.items():
            assert own[name].shape == tensor.shape, f"{name}: HF {tuple(own[name].shape)} vs ours {tuple(tensor.shape)}"
            own[name].copy_(tensor.to(own[name].dtype))    # e_score_correction_bias / gate stay as HF keeps them
    return model


def hf_logits(model: DeepseekV3ForCausalLM, ids) -> np.ndarray:
    """Logits [T, V] as float64 for one sequence at positions 0..T-1."""
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(np.asarray(ids, dtype=np.int64))[None], use_cache=False)
    return out.logits[0].double().numpy()
