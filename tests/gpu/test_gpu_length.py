"""The LoLCATs length options (gated linear state, features before RoPE) on CUDA (skipped elsewhere): the
fused decode step against the PyTorch ring step, token for token and step output for step output."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

OPTIONS = [{"decay": "gated"}, {"feature_rope": False}, {"feature_rope": False, "decay": "gated"}, {"decay": "span"}]


@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_fused_length_step_equals_the_ring_step_on_cuda(family, option):
    from transformers import AutoModelForCausalLM

    import linearize
    from helpers import tiny_config
    from linearize.convert import mixers
    from linearize.fast import FastDecoder
    from linearize.mixers.lolcats import LolcatsAttention

    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(tiny_config(family)).eval().cuda()
    model = linearize.convert(teacher, {"kind": "lolcats", "window": 8, "feature_dim": 8, "decay_horizon": 16,
                                        **option})
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in mixers(model).values():
            if hasattr(m, "gate_proj"):
                m.gate_proj.weight.copy_(torch.randn(m.gate_proj.weight.shape, generator=gen).cuda())
    assert all(m.fused_decoding() for m in mixers(model).values())
    model.generation_config.eos_token_id = None
    ids = torch.randint(2, 97, (3, 21), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)
    mask[2, :12] = 0  # left padding: empty slots in the ring
    fused = FastDecoder(model).generate(ids, mask, max_new_tokens=24)
    on_cuda = LolcatsAttention.fused_decoding
    LolcatsAttention.fused_decoding = lambda self: False
    try:
        ring = FastDecoder(model).generate(ids, mask, max_new_tokens=24)
    finally:
        LolcatsAttention.fused_decoding = on_cuda
    assert torch.equal(fused, ring)
