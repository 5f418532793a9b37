import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, os.cpu_count() or 1))


def tiny_config(family: str, **overrides):
    """A few-layer random model of each supported family, small enough for float64 CPU tests."""
    from transformers import AutoConfig

    common = dict(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=6, max_position_embeddings=256)
    per_family = {
        "llama": dict(num_key_value_heads=2, attention_bias=False),
        "qwen2": dict(num_key_value_heads=2),  # q/k/v biases
        "qwen3": dict(num_key_value_heads=3, head_dim=8),  # per-head q_norm / k_norm
        "mistral": dict(num_key_value_heads=1, sliding_window=None),  # multi-query
        "gemma2": dict(num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=12,
                       attn_logit_softcapping=20.0, final_logit_softcapping=None, sliding_window=4096),
        "gpt_neox": dict(rotary_pct=0.5, use_parallel_residual=True),
    }[family]
    cfg = AutoConfig.for_model(family, **{**common, **per_family, **overrides})
    cfg._attn_implementation = "eager" if family == "gemma2" else "sdpa"
    return cfg


@pytest.fixture
def tiny_model():
    from transformers import AutoModelForCausalLM

    def make(family="llama", dtype=torch.float32, seed=0, **overrides):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides)).to(dtype).eval()
        return model

    return make
