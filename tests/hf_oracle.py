"""transformers' DeepseekV3ForCausalLM on our ModelConfig + weights: the independent oracle (tests only).

The config translation and the weight loading are the torch engine's (conformance/engines/torch_engine.py:
`hf_config`, `load_weights`; the transformers traps are listed there). Here the model is plain eager
transformers in any dtype, float64 included (experts_implementation="eager" makes that possible).
"""
from __future__ import annotations

import numpy as np
import torch
from transformers import DeepseekV3ForCausalLM

from conformance.engines.torch_model import hf_config, load_weights
from refmodel.config import ModelConfig


def hf_model(cfg: ModelConfig, W: dict[str, np.ndarray], dtype=torch.float32) -> DeepseekV3ForCausalLM:
    """An eval-mode DeepseekV3ForCausalLM holding exactly W (per-expert tensors fused as transformers v5 wants)."""
    model = DeepseekV3ForCausalLM._from_config(hf_config(cfg), attn_implementation="eager",
                                               experts_implementation="eager").to(dtype).eval()
    load_weights(model, cfg, W)
    return model


def hf_logits(model: DeepseekV3ForCausalLM, ids) -> np.ndarray:
    """Logits [T, V] as float64 for one sequence at positions 0..T-1."""
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(np.asarray(ids, dtype=np.int64))[None], use_cache=False)
    return out.logits[0].double().numpy()
