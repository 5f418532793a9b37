"""Run by tests/distill/test_frozen_teacher_fsdp.py under ``torch.distributed.run`` (2 gloo processes):
``mixer_mse`` (the alignment stage) on a student sharded with FSDP2 as accelerate's FSDP config shards
it (each decoder layer a unit, then the root) gives the loss and the gradients of the whole student, and
``unsharded`` then gathers a plain student on the CPU; prints "sharded mixer_mse agrees".

The loss feeds each layer the teacher's hidden states and compares a mixer's output inside the layer,
so without care the backward never reaches a layer's output, where FSDP2 gathers the layer's weights
for its backward: the weights would still be freed shards there."""

import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers.py
from helpers import tiny_config  # noqa: E402

import linearize  # noqa: E402
from linearize.distill import FrozenTeacher, build_objective  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    objective = build_objective("mixer_mse", teacher=FrozenTeacher(teacher))
    student = linearize.convert(copy.deepcopy(teacher), {"kind": "supra"})
    whole = copy.deepcopy(student)
    batch = {"input_ids": torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))}  # same on both
    expected = objective(whole, batch)
    expected.backward()
    mesh = init_device_mesh("cpu", (2,))
    for layer in student.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(student, mesh=mesh)
    loss = objective(student, batch)
    loss.backward()  # FSDP averages the gradients over the processes: the batch is the same on both
    assert torch.allclose(loss.detach(), expected.detach(), rtol=1e-5), (float(loss), float(expected))
    grads = dict(whole.named_parameters())
    checked = 0
    for name, p in student.named_parameters():
        ref = grads[name].grad
        got = None if p.grad is None else p.grad.full_tensor()
        if ref is None or not ref.abs().max() > 0:  # parameters the loss does not reach: no gradient, or zeros
            assert got is None or not got.abs().max() > 0, name
            continue
        assert got is not None, name
        assert torch.allclose(got, ref, atol=1e-6, rtol=1e-4), (name, (got - ref).abs().max())
        checked += 1
    assert checked >= 2 * tiny_config("llama").num_hidden_layers, checked  # every layer's mixer got its gradient
    # between stages (uptrain._plain): gathered whole on the CPU, a plain model again, whose decoder layers
    # the next stage's Trainer finds by their class to shard afresh
    from torch.distributed.fsdp import FSDPModule

    from linearize.recipes.engine import unsharded

    plain = unsharded(student, device="cpu")
    assert not any(isinstance(m, FSDPModule) for m in plain.modules())
    assert {type(m) for m in plain.model.layers} == {type(whole.model.layers[0])}
    for name, t in whole.state_dict().items():
        assert torch.equal(plain.state_dict()[name], t), name
    dist.barrier()
    if rank == 0:
        print("sharded mixer_mse agrees")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
