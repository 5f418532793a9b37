"""Run by tests/recipes/test_launch.py: attention transfer's loss and gradients under FSDP2 on 2 gloo
processes against one unsharded process. ``python fsdp_attention_transfer.py DIR`` writes the
reference to DIR; under ``torch.distributed.run`` (2 processes) it compares and prints "gradients agree"."""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers.py
from helpers import tiny_config  # noqa: E402

import linearize  # noqa: E402
from linearize.distill import build_objective  # noqa: E402


def student():
    torch.manual_seed(0)
    model = linearize.convert(AutoModelForCausalLM.from_config(tiny_config("llama")),
                              {"kind": "lolcats", "window": 4, "feature_dim": 8})
    for name, p in model.named_parameters():
        p.requires_grad_("feature_map" in name)
    return model


def loss_and_grads(model, ids):
    loss_fn = build_objective("attention_mse", context=dict(layers=(0, 1, 2), mse_factor=1.0, xent_factor=0.0))
    loss = loss_fn(model, {"input_ids": ids, "labels": ids})
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            grads[name] = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
    return loss.detach(), grads


def main(folder: Path) -> None:
    torch.manual_seed(1)
    ids = torch.randint(0, 97, (4, 16))
    if "RANK" not in os.environ:
        torch.save(loss_and_grads(student(), ids), folder / "one.pt")
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = student()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    per = ids.shape[0] // world
    loss, grads = loss_and_grads(model, ids[rank * per : (rank + 1) * per])
    dist.all_reduce(loss)
    loss /= world
    if rank == 0:
        loss1, grads1 = torch.load(folder / "one.pt")
        assert set(grads) == set(grads1) and len(grads) == 6, sorted(grads)
        assert torch.allclose(loss, loss1, rtol=1e-5), (float(loss), float(loss1))
        for name, g in grads1.items():
            assert g.abs().max() > 0, name
            assert torch.allclose(grads[name], g, rtol=1e-4, atol=1e-6 * float(g.abs().max())), name
        print("gradients agree")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
