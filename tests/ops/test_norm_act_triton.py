"""The fast decoder's RMSNorm and gated-activation kernels (``ops/rms_norm_triton.py``, ``ops/gated_act_triton.py``)
and their PyTorch twins (``ops/norm_act.py``): the twins equal the families' modules bit for bit, and the kernels,
run on the CPU by Triton's interpreter (``triton_interpret_norm_act.py``), equal the modules."""

import pytest
import torch

from helpers import run_triton_interpreter_script, tiny_config

from linearize.ops.norm_act import gated_act, rms_norm, rms_norm_dtype

WEIGHT = ("llama", "mistral", "qwen2", "qwen3", "smollm3")  # normalised, rounded, times the weight
OFFSET = ("gemma", "gemma2", "gemma3_text")  # normalised, times 1 + weight in fp32, rounded once


def _model(family):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(family)).eval()


@pytest.mark.parametrize("family", WEIGHT + OFFSET)
def test_the_twins_are_the_families_modules_bit_for_bit(family):
    model = _model(family)
    g = torch.Generator().manual_seed(0)
    norm, mlp = model.model.norm, model.model.layers[0].mlp
    with torch.no_grad():
        norm.weight.copy_(torch.randn(norm.weight.shape, generator=g))
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    act = "silu" if family in WEIGHT else "gelu_tanh"
    for x_dtype, w_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                             (torch.bfloat16, torch.float32), (torch.float16, torch.float16)):
        norm.to(w_dtype)
        x = (torch.randn(4, 3, norm.weight.shape[0], generator=g) * 3 + 1).to(x_dtype)
        want = norm(x)
        got = rms_norm(x, norm.weight, eps, offset=family in OFFSET)
        assert got.dtype == want.dtype == rms_norm_dtype(x_dtype, w_dtype, family in OFFSET)
        assert torch.equal(got, want), (x_dtype, w_dtype)
        # the other variant is another function: the twin's switch matters
        assert not torch.equal(rms_norm(x, norm.weight, eps, offset=family not in OFFSET).to(want.dtype), want)
        h = (torch.randn(4, 2 * mlp.up_proj.out_features, generator=g) * 3).to(x_dtype)
        gate, up = h.chunk(2, dim=-1)
        assert torch.equal(gated_act(h, act), mlp.act_fn(gate) * up)


def test_rms_norm_kernel_equals_the_families_modules():
    """Llama's, Qwen3's (per-head, on a strided view of the fused q/k/v product) and Gemma's RMSNorm in fp32,
    bf16 (with bf16 or fp32 weights) and fp16; rows across programs, one row, long rows."""
    run_triton_interpreter_script("triton_interpret_norm_act.py", "norm")


def test_add_rms_norm_kernel_equals_the_add_and_the_module():
    """A pre-norm layer's residual add and the norm after it in one launch: the sum bit for bit as the layer's
    ``residual + x``, the norm as the module's on it (Llama's and Gemma's, fp32 / bf16 / fp16)."""
    run_triton_interpreter_script("triton_interpret_norm_act.py", "add_norm")


def test_gated_act_kernel_equals_the_mlps():
    """SiLU (Llama) and GELU's tanh form (Gemma) times up in fp32, bf16 and fp16; the stand-in modules
    ``FusedRMSNorm`` and ``FusedGatedMLP`` with the kernel against the modules they replace."""
    run_triton_interpreter_script("triton_interpret_norm_act.py", "act")
