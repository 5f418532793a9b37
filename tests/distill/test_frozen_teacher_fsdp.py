"""A frozen teacher sharded like an FSDP student (``FrozenTeacher(shard=True)``), on 2 gloo processes;
and where its weights wait before they are sharded."""

import warnings
from pathlib import Path

import torch
from torch import nn

from helpers import run_two_processes, tiny_config


def test_a_sharded_frozen_teacher_gives_the_whole_copys_outputs():
    assert "sharded teacher agrees" in run_two_processes(Path(__file__).with_name("frozen_teacher_fsdp.py"))


def _on_a_fake_gpu(model: nn.Module, mode) -> nn.Module:
    """``model`` with every parameter and buffer replaced by a fake tensor on cuda:0 (no data, no GPU
    needed: ``FakeTensorMode``), tied weights kept tied."""
    from torch._subclasses.fake_tensor import FakeTensor

    made = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None and id(t) not in made:
                    fake = FakeTensor(mode, torch.empty_like(t, device="meta"), torch.device("cuda", 0))
                    made[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) \
                        else fake
                if t is not None:
                    table[name] = made[id(t)]
    return model


def test_a_copy_to_shard_is_made_on_the_cpu_not_on_the_teachers_gpu():
    """Under FSDP the frozen copy of a teacher on the GPU (SUPRA's) is made on the CPU, tensor by tensor,
    in bf16, its tied weights tied: no second whole teacher on the GPU before fully_shard moves each
    unit there. The teacher sits on a fake GPU (shapes and devices only), so this runs on any machine."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from linearize.distill import FrozenTeacher

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    config = tiny_config("llama")
    config.tie_word_embeddings = True
    teacher = _on_a_fake_gpu(AutoModelForCausalLM.from_config(config), mode)
    assert {t.device.type for t in teacher.state_dict().values()} == {"cuda"}
    with mode, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deepcopy reads the fake tensors' data pointers
        frozen = FrozenTeacher(teacher, shard=True)
    staged = frozen.model.state_dict()
    assert {t.device.type for t in staged.values()} == {"cpu"} and not frozen.sharded
    assert {p.dtype for p in frozen.model.parameters()} == {torch.bfloat16}  # bf16, as a copy from CUDA is
    assert frozen.model.lm_head.weight is frozen.model.model.embed_tokens.weight
    assert not any(p.requires_grad for p in frozen.model.parameters())
    assert {t.device.type for t in teacher.state_dict().values()} == {"cuda"}  # the teacher itself is left be


def test_a_teacher_loaded_on_the_cpu_to_shard_is_bf16_where_cuda_is_there(monkeypatch, tiny_model):
    """Under FSDP a recipe loads the teacher on the CPU; with a GPU to shard it onto, its frozen copy is
    bf16, as a copy of a teacher on the GPU is; without one, its dtype is kept."""
    from linearize.distill import FrozenTeacher

    assert {p.dtype for p in FrozenTeacher(tiny_model(), shard=True).model.parameters()} == {torch.float32}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    frozen = FrozenTeacher(tiny_model(), shard=True)
    assert {p.dtype for p in frozen.model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in frozen.model.parameters()} == {"cpu"}


def test_mixer_mse_on_a_sharded_student_gives_the_whole_students_gradients():
    """The alignment stage under FSDP: mixer_mse on a student sharded per layer has the loss and the
    gradients of the whole student (the backward reaches each layer's output, where FSDP gathers its
    weights)."""
    assert "sharded mixer_mse agrees" in run_two_processes(Path(__file__).with_name("mixer_mse_fsdp.py"))
