"""Building the torch engine's model: our ModelConfig as transformers' DeepseekV3Config, the bundle's
weights under their HF names (fused or per-expert experts), a user module's class from `--module
pkg.mod:Class`, and the tapped eager attention that shows the engine the rotated query. What a user module
must look like: conformance/engines/torch_engine.py.
"""
from __future__ import annotations

import importlib

import numpy as np
import torch
from transformers import AttentionInterface, DeepseekV3Config, DeepseekV3ForCausalLM, PreTrainedModel
from transformers.models.deepseek_v3.modeling_deepseek_v3 import eager_attention_forward

from conformance.precision import FP32_KEEP
from refmodel.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ATTENTION = "kdtr_tapped_eager"     # transformers' eager attention, plus a look at the rotated query


class TorchEngineError(ValueError):
    """The module or the weights cannot be used as a torch engine (the message names the fix)."""


def _tapped_eager(module, query, key, value, attention_mask, **kwargs):
    """Eager attention that first hands the query [1, H, T, A] (RoPE applied) to the engine's recorder."""
    record = getattr(module, "_kdtr_record_q", None)
    if record is not None:
        record(query)
    return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(ATTENTION, _tapped_eager)


def hf_config(cfg: ModelConfig) -> DeepseekV3Config:
    """Our ModelConfig as transformers' DeepseekV3Config. Traps: n_group/topk_group always set;
    max_position_embeddings = factor x original (some revisions recompute the factor from it); mscale and
    mscale_all_dim passed through; rope_interleave left at its default (True: the checkpoint layout)."""
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


def hf_state(cfg: ModelConfig, W: dict[str, np.ndarray], fused_experts: bool) -> dict[str, torch.Tensor]:
    """Our weights (HF names, one tensor per expert) as a state dict; `fused_experts`: transformers v5's
    `mlp.experts.gate_up_proj` [E, 2I, D] and `mlp.experts.down_proj` [E, D, I] instead."""
    state = {n: torch.from_numpy(np.ascontiguousarray(a)) for n, a in W.items()
             if not (fused_experts and ".mlp.experts." in n)}
    if fused_experts:
        for l in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
            p, E = f"model.layers.{l}.mlp.experts.", range(cfg.n_routed_experts)
            gate_up = [np.concatenate([W[p + f"{e}.gate_proj.weight"], W[p + f"{e}.up_proj.weight"]]) for e in E]
            state[p + "gate_up_proj"] = torch.from_numpy(np.stack(gate_up))                      # [E, 2I, D]
            state[p + "down_proj"] = torch.from_numpy(np.stack([W[p + f"{e}.down_proj.weight"] for e in E]))
    return state


def load_module_class(path: str) -> type:
    """`pkg.mod:Class` (or `pkg.mod.Class`) -> the class, with a clear error for each way it can fail."""
    mod_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not mod_name or not attr:
        raise TorchEngineError(f"--module {path!r}: give an import path like 'mypkg.model:MyDeepseekV3'")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise TorchEngineError(f"--module {path!r}: cannot import {mod_name!r} ({e}); is it on PYTHONPATH?") from None
    cls = getattr(mod, attr, None)
    if not isinstance(cls, type) or not issubclass(cls, torch.nn.Module):
        raise TorchEngineError(f"--module {path!r}: {mod_name}.{attr} is not a torch.nn.Module class")
    return cls


def load_weights(model: torch.nn.Module, cfg: ModelConfig, W: dict) -> None:
    """Copy W into the model's own tensors (each in the dtype it has), after checking every name and shape:
    `load_state_dict` would silently skip per-expert names on a fused-experts model."""
    own = model.state_dict()
    state = hf_state(cfg, W, fused_experts=any(n.endswith("mlp.experts.gate_up_proj") for n in own))
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise TorchEngineError(f"{type(model).__name__}'s parameters do not carry the HF names of the bundle: "
                               f"missing {missing[:4]}, unexpected {unexpected[:4]} (a torch engine module "
                               f"names its parameters as transformers' DeepseekV3ForCausalLM)")
    with torch.no_grad():
        for name, t in state.items():
            if tuple(own[name].shape) != tuple(t.shape):
                raise TorchEngineError(f"{name}: the module has shape {tuple(own[name].shape)}, the bundle "
                                       f"{tuple(t.shape)}")
            own[name].copy_(t.to(own[name].dtype))


def build_model(cfg: ModelConfig, W: dict, module: str | None = None, dtype: str = "float32",
                device: str = "cpu") -> torch.nn.Module:
    """An eval-mode model holding exactly W: weights in `dtype`, router gate and bias in float32."""
    config = hf_config(cfg)
    cls = DeepseekV3ForCausalLM if module is None else load_module_class(module)
    if issubclass(cls, PreTrainedModel):
        model = cls._from_config(config, attn_implementation=ATTENTION, experts_implementation="eager")
    else:
        config._attn_implementation = ATTENTION
        model = cls(config)
    load_weights(model, cfg, W)
    with torch.no_grad():
        for name, p in model.named_parameters():                        # weights to dtype; buffers (the
            if not name.endswith(FP32_KEEP):                             # RoPE inv_freq, the router bias)
                p.data = p.data.to(DTYPES[dtype])                        # stay float32 as in from_pretrained
    return model.to(device).eval()
