"""ModelConfig: presets, derived YaRN constants, config.json reading, validation messages."""
import dataclasses
import json

import pytest

from refmodel.config import PRESETS, ModelConfig


def test_tiny_preset_keeps_its_shapes_and_constants():
    c = PRESETS["tiny"]
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.vocab_size) == (192, 6, 6, 400)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (96, 64, 32, 16, 32)
    assert (c.intermediate_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok) == (384, 32, 16, 4)
    assert (c.n_shared_experts, c.first_k_dense_replace, c.n_group, c.topk_group) == (1, 1, 1, 1)
    assert c.norm_topk_prob is True and c.routed_scaling_factor == 2.827 and c.rope_theta == 50000
    assert c.rope_scaling == {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                              "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    assert c.max_position_embeddings == 262144 and c.rms_norm_eps == 1e-5 and c.tie_word_embeddings is False
    assert c.latent_norm_eps == 1e-6


def test_k26_softmax_scale_carries_the_yarn_mscale():
    c = PRESETS["k26"]
    assert c.qk_head_dim == 192
    assert c.softmax_scale == pytest.approx(0.144680, abs=5e-7)       # 192^-1/2 * (1 + 0.1 ln 64)^2
    assert c.rope_attention_factor == 1.0
    k2 = dataclasses.replace(c, rope_scaling={**c.rope_scaling, "factor": 32.0})
    assert k2.softmax_scale == pytest.approx(0.130861, abs=5e-7)


def test_round_trip_through_json():
    for c in PRESETS.values():
        assert ModelConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_from_hf_reads_k25_wrapper_and_v5_rope_parameters():
    d = PRESETS["k26"].to_dict()
    rope = d.pop("rope_scaling")
    theta = d.pop("rope_theta")
    d.pop("latent_norm_eps")
    text = {**d, "model_type": "kimi_k2", "num_key_value_heads": 64, "hidden_act": "silu",
            "rope_scaling": rope, "rope_theta": theta}
    assert ModelConfig.from_hf({"architectures": ["KimiK25ForConditionalGeneration"], "text_config": text}) == PRESETS["k26"]
    v5 = {**d, "rope_parameters": {**{k: v for k, v in rope.items() if k != "type"}, "rope_type": "yarn",
                                   "rope_theta": theta}}
    assert ModelConfig.from_hf(v5) == PRESETS["k26"]


def test_from_hf_missing_field_is_named():
    d = PRESETS["tiny"].to_dict()
    del d["kv_lora_rank"]
    with pytest.raises(ValueError, match="config.json has no field 'kv_lora_rank'"):
        ModelConfig.from_hf(d)


@pytest.mark.parametrize("change, message", [
    ({"n_group": 3}, r"ModelConfig.n_group = 3: must divide n_routed_experts \(16\)"),
    ({"topk_group": 2}, r"ModelConfig.topk_group = 2: must be <= n_group \(1\)"),
    ({"qk_rope_head_dim": 15}, r"ModelConfig.qk_rope_head_dim = 15: must be even"),
    ({"num_experts_per_tok": 17}, r"ModelConfig.num_experts_per_tok = 17: must be <= n_routed_experts \(16\)"),
    ({"q_lora_rank": None}, r"ModelConfig.q_lora_rank = None: must be a positive int \(q_lora_rank None"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"rope_scaling\['type'\]\ = 'linear'"),
    ({"first_k_dense_replace": 7}, r"first_k_dense_replace = 7: must be <= num_hidden_layers \(6\)"),
])
def test_validation_errors_name_field_value_and_fix(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(PRESETS["tiny"], **change)


def test_presets_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["tiny"].hidden_size = 7
