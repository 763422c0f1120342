"""model_flops against FLOP counts of Hugging Face models (eager attention) built from the same config.json."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from attnlab import MLAConfig
from attnlab.bench import count_flops
from attnlab.cost import from_hf_config, model_flops

SMALL = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
DEEPSEEK = dict(
    SMALL, num_hidden_layers=3, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8,
    num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
)  # fmt: skip


def hf_config(name: str):
    t = transformers
    return {
        "llama": lambda: t.LlamaConfig(**SMALL, num_attention_heads=8, num_key_value_heads=2, head_dim=12),
        "qwen2": lambda: t.Qwen2Config(**SMALL, num_attention_heads=4, num_key_value_heads=2),
        "gpt2": lambda: t.GPT2Config(vocab_size=100, n_positions=32, n_embd=64, n_layer=2, n_head=4),
        "deepseek_v2": lambda: t.DeepseekV2Config(**DEEPSEEK, q_lora_rank=None, n_shared_experts=2),
        "deepseek_v3": lambda: t.DeepseekV3Config(**DEEPSEEK, q_lora_rank=24, n_shared_experts=1),
    }[name]()


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny ops; see test_cost_flops.py
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2", "deepseek_v2", "deepseek_v3"])
def test_model_flops_equal_hf_model_counts(name):
    config = hf_config(name)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    ours = from_hf_config(config.to_dict())
    if isinstance(ours.attention, MLAConfig):
        # Hugging Face's DeepSeek attention decompresses K and V: our "naive" mode
        ours = ours.with_attention(ours.attention.replace(mode="naive"))
    tokens = torch.randint(0, 100, (2, 7))
    with torch.no_grad(), count_flops() as fc:
        model(tokens)
    assert fc.total == model_flops(ours, 2, 7).total, fc.by_op
    if ours.is_moe:
        # its routed experts run on aten._grouped_mm, which plain FlopCounterMode does not count
        assert fc.by_op.get("_grouped_mm", 0) > 0
    else:
        with torch.no_grad(), FlopCounterMode(display=False) as plain:
            model(tokens)
        assert plain.get_total_flops() == fc.total
