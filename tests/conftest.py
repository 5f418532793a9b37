import os

import pytest
import torch

from helpers import tiny_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture
def tiny_model():
    from transformers import AutoModelForCausalLM

    def make(family="llama", dtype=torch.float32, seed=0, **overrides):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides)).to(dtype).eval()
        return model

    return make
