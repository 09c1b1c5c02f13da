"""Building a `--engine torch` model from a bundle: transformers' DeepseekV3ForCausalLM or the user's port
(`--module pkg.mod:Class`), its config, its weights under the HF names, and its declared RoPE layout. The
contract a port meets is docs/engine-api.md, "The --module contract"; each way a port can miss it is one
line naming what the bundle expected.

A port that sets `kdtr_int4_packed = True` receives the INT4 linears as the checkpoint stores them
(compressed-tensors `<m>.weight_packed` int32 [N, K/8], `<m>.weight_scale` bfloat16 [N, K/32],
`<m>.weight_shape` int64 [2]; docs/int4.md) and decodes them itself; any other port gets them dequantized
by kdtr, which the verdict then lists as done by kdtr, not judged (conformance/verify/not_judged.py).
"""
from __future__ import annotations

import numpy as np
import torch
from transformers import AttentionInterface, DeepseekV3Config, DeepseekV3ForCausalLM, PreTrainedModel
from transformers.models.deepseek_v3.modeling_deepseek_v3 import eager_attention_forward

from conformance.engines.user_module import UserModuleError, import_class
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


# ---------------------------------------------------------------- building the model

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


INT4_PACKED = ("weight_packed", "weight_scale", "weight_shape")      # compressed-tensors' names, docs/int4.md


def packed_state(W) -> dict[str, torch.Tensor]:
    """The INT4 linears of stored weights W (refmodel.stored.StoredWeights) as the checkpoint stores them."""
    state = {}
    for name, a, kind in W.stored_items():
        if name.endswith(".qw"):
            m = name[:-3]
            state[m + ".weight_packed"] = torch.from_numpy(np.array(a, np.int32))              # [N, K/8]
            state[m + ".weight_shape"] = torch.tensor([a.shape[0], a.shape[1] * 8], dtype=torch.int64)
        elif name.endswith(".sc"):                                       # bf16 bits, or float scales
            sc = np.array(a)
            state[name[:-3] + ".weight_scale"] = (torch.from_numpy(sc.view(np.int16)).view(torch.bfloat16)
                                                  if kind == "bfloat16" else torch.from_numpy(sc.astype(np.float32)))
    return state


def int4_modules(W) -> list[str]:
    """The INT4 linears of W (stored weights; a plain dict has none), as their dense `<m>.weight` names."""
    names = W.stored_names() if hasattr(W, "stored_names") else []      # names only: no tensor is read
    return [n[:-3] + ".weight" for n in names if n.endswith(".qw")]


def hf_state(cfg: ModelConfig, W: dict[str, np.ndarray], fused_experts: bool,
             packed: bool = False) -> dict[str, torch.Tensor]:
    """Our weights (HF names, one tensor per expert) as a state dict; `fused_experts`: transformers v5's
    `mlp.experts.gate_up_proj` [E, 2I, D] and `mlp.experts.down_proj` [E, D, I] instead; `packed`: the INT4
    linears as stored (packed_state), never dequantized."""
    skip = set(int4_modules(W)) if packed else set()
    if skip and fused_experts:
        raise TorchEngineError("kdtr_int4_packed = True needs one module per expert (mlp.experts.{e}.gate_proj "
                               "with weight_packed, weight_scale, weight_shape), not fused gate_up_proj / "
                               "down_proj tensors (docs/engine-api.md)")
    state = {n: torch.from_numpy(np.ascontiguousarray(W[n])) for n in W
             if n not in skip and not (fused_experts and ".mlp.experts." in n)}
    if skip:
        state.update(packed_state(W))
    if fused_experts:
        for l in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
            p, E = f"model.layers.{l}.mlp.experts.", range(cfg.n_routed_experts)
            gate_up = [np.concatenate([W[p + f"{e}.gate_proj.weight"], W[p + f"{e}.up_proj.weight"]]) for e in E]
            state[p + "gate_up_proj"] = torch.from_numpy(np.stack(gate_up))                      # [E, 2I, D]
            state[p + "down_proj"] = torch.from_numpy(np.stack([W[p + f"{e}.down_proj.weight"] for e in E]))
    return state


ROPE_LAYOUTS = ("interleaved", "deinterleaved")


def port_class(path: str | None) -> type:
    """The model class: transformers' DeepseekV3ForCausalLM, or `pkg.mod:Class` (a torch.nn.Module)."""
    if path is None:
        return DeepseekV3ForCausalLM
    try:
        cls = import_class(path, example="mypkg.model:MyDeepseekV3")
    except UserModuleError as e:
        raise TorchEngineError(str(e)) from None
    if not issubclass(cls, torch.nn.Module):
        raise TorchEngineError(f"--module {path!r}: {cls.__module__}.{cls.__name__} is not a torch.nn.Module class "
                               f"(a --engine torch port is a model; a class that implements the Engine protocol "
                               f"itself runs with --engine python, docs/engine-api.md)")
    layout = getattr(cls, "kdtr_rope_layout", "deinterleaved")
    if layout not in ROPE_LAYOUTS:
        raise TorchEngineError(f"--module {path!r}: {cls.__name__}.kdtr_rope_layout is {layout!r}; declare "
                               f"'interleaved' (the checkpoint's pairs (2i, 2i+1)) or 'deinterleaved' "
                               f"(transformers': [evens; odds])")
    return cls


def rope_layout(cls: type) -> tuple[str, bool]:
    """(the layout a port's q, k_pe and cached k_pe rows are in, whether the class declared it). A class
    that does not declare `kdtr_rope_layout` is judged in transformers' de-interleaved layout."""
    return getattr(cls, "kdtr_rope_layout", "deinterleaved"), hasattr(cls, "kdtr_rope_layout")


def load_weights(model: torch.nn.Module, cfg: ModelConfig, W: dict) -> None:
    """Copy W into the model's own tensors (each in the dtype it has), after checking every name and shape:
    `load_state_dict` would silently skip per-expert names on a fused-experts model. A model whose class sets
    `kdtr_int4_packed = True` gets the INT4 linears packed (module docstring)."""
    own = model.state_dict()
    state = hf_state(cfg, W, fused_experts=any(n.endswith("mlp.experts.gate_up_proj") for n in own),
                     packed=getattr(type(model), "kdtr_int4_packed", False) is True)
    lacking, extra = sorted(set(state) - set(own)), sorted(set(own) - set(state))
    if lacking or extra:
        said = [f"the bundle's {len(lacking)} tensor(s) {_few(lacking)} have no parameter of that name in the "
                f"module"] if lacking else []
        said += [f"the module's {len(extra)} parameter(s) {_few(extra)} are not in the bundle"] if extra else []
        raise TorchEngineError(f"{type(model).__name__}'s parameters do not carry the HF names of the bundle: "
                               f"{'; '.join(said)} (a torch port names its parameters as transformers' "
                               f"DeepseekV3ForCausalLM: docs/engine-api.md)")
    with torch.no_grad():
        for name, t in state.items():
            if tuple(own[name].shape) != tuple(t.shape):
                raise TorchEngineError(f"{name}: the module has shape {tuple(own[name].shape)}, the bundle "
                                       f"{tuple(t.shape)}")
            own[name].copy_(t.to(own[name].dtype))


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def build_model(cfg: ModelConfig, W: dict, module: str | None = None, dtype: str = "float32",
                device: str = "cpu") -> torch.nn.Module:
    """An eval-mode model holding exactly W: weights in `dtype`, router gate and bias in float32."""
    config = hf_config(cfg)
    cls = port_class(module)
    if issubclass(cls, PreTrainedModel):
        model = cls._from_config(config, attn_implementation=ATTENTION, experts_implementation="eager")
    else:
        config._attn_implementation = ATTENTION
        model = cls(config)
    load_weights(model, cfg, W)
    with torch.no_grad():
        for name, p in model.named_parameters():                        # weights to dtype; buffers (the
            if not name.endswith(FP32_KEEP + INT4_PACKED) and p.is_floating_point():   # RoPE inv_freq, the
                p.data = p.data.to(DTYPES[dtype])                        # router bias) stay float32 as in
                #                                                          from_pretrained; INT4 as stored
    return model.to(device).eval()
