"""Run by tests/distill/test_frozen_teacher_fsdp.py under ``torch.distributed.run`` (2 gloo processes):
a ``FrozenTeacher`` sharded with FSDP2 (``shard=True``) holds half of each weight per process and gives
the same logits, attention outputs and KL loss as the whole copy; prints "sharded teacher agrees"."""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
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
    student = linearize.convert(teacher, {"kind": "supra"})
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(rank))
    whole, sharded = FrozenTeacher(teacher), FrozenTeacher(teacher, shard=True)
    a = whole(student, ids, attention_of=(0, 2))
    b = sharded(student, ids, attention_of=(0, 2))
    assert sharded.sharded
    for name in ("model.embed_tokens.weight", "model.layers.1.mlp.up_proj.weight"):  # root unit, a layer's
        local = sharded.model.get_parameter(name).to_local()  # between forwards each process holds half
        rows = teacher.get_parameter(name).shape[0]
        assert local.shape[0] == (rows + 1) // 2 - rank * (rows % 2), (name, local.shape)
    assert torch.allclose(a.logits, b.logits, atol=1e-5), (a.logits - b.logits).abs().max()
    for i in (0, 2):
        assert torch.allclose(a.attention[i], b.attention[i], atol=1e-5), i
    batch = {"input_ids": ids, "labels": ids}
    kl_whole = build_objective("kl", teacher=whole)(student, batch)
    kl_sharded = build_objective("kl", teacher=sharded)(student, batch)
    assert torch.allclose(kl_whole, kl_sharded, rtol=1e-5), (float(kl_whole), float(kl_sharded))
    dist.barrier()
    if rank == 0:
        print("sharded teacher agrees")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
