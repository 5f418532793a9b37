"""Learning from the teacher on CUDA: the frozen teacher in bf16 without gradients, the alignment and
KL losses through the retention's fla kernels, and a few steps that bring an XATL student closer
(skipped without CUDA)."""

import copy

import pytest
import torch

from linearize.distill import FrozenTeacher, build_objective
from linearize.convert.xatl_transfer import build_xatl

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _teacher(tiny_model):
    return tiny_model("llama", num_hidden_layers=4, hidden_size=128, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=256).cuda()


def test_frozen_teacher_is_bf16_and_takes_no_gradient(tiny_model):
    teacher = _teacher(tiny_model)
    frozen = FrozenTeacher(teacher)
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in frozen.model.parameters())
    assert all(p.dtype == torch.float32 for p in teacher.parameters())  # the original untouched


@pytest.mark.parametrize("loss", ["mixer_mse", "kl", "kl+lm", "hidden_mse"])
def test_xatl_distillation_step_on_cuda(tiny_model, loss):
    teacher = _teacher(tiny_model)
    student, _ = build_xatl(copy.deepcopy(teacher), "retnet", transfer="embeddings,ffn,wo,qkv", keep_softmax=[2],
                            seed=0)
    ids = torch.randint(0, 97, (4, 256), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    objective = build_objective(loss, {"kl": {"top_k": 16}} if loss == "kl" else None, teacher=FrozenTeacher(teacher))
    opt = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=2e-3)
    values = []
    for _ in range(8):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            value = objective(student, batch)
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        values.append(value.item())
    assert all(torch.isfinite(torch.tensor(values)))
    assert values[-1] < values[0], values
    assert all(p.grad is None for p in objective.teacher.model.parameters())
