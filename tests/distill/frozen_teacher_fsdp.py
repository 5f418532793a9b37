"""Run by tests/distill/test_frozen_teacher_fsdp.py under ``torch.distributed.run`` (2 gloo processes):
a ``FrozenTeacher`` sharded with FSDP2 (``shard=True``) holds half of each weight per process and gives
the same logits, attention outputs and KL loss as the whole copy; prints "sharded teacher agrees".

Its weights wait on the CPU until ``fully_shard`` takes them: a copy (SUPRA's) is its own, made on the
CPU, and a model kept as it is (XATL's) is moved there; each call of ``fully_shard`` finds every weight
not yet sharded still in that CPU tensor, so none was put whole on another device before sharding. (On
gloo the process's device is the CPU too: the move of each shard to a GPU is FSDP2's, not checked here.)"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.fsdp as fsdp
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
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
    kept_model = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    kept_model.load_state_dict(teacher.state_dict())
    kept = FrozenTeacher(kept_model, copy_model=False, shard=True)
    assert kept.model is kept_model
    source = {t.data_ptr() for t in teacher.state_dict().values()}
    staged = {}  # (teacher, name) -> where its weight waits until fully_shard takes it
    for frozen in (sharded, kept):
        for name, t in frozen.model.state_dict().items():
            assert t.device.type == "cpu", name
            assert frozen is kept or t.data_ptr() not in source, name  # a copy: its own tensors
            staged[id(frozen.model), name] = t.data_ptr()
    calls = []

    def watched(module, **kwargs):
        # every weight of the teacher being sharded that is not sharded yet is still the staged CPU tensor
        root = next(m for m in (sharded.model, kept.model) if any(module is x for x in m.modules()))
        for name, t in root.state_dict().items():
            if not isinstance(t, DTensor):
                assert t.device.type == "cpu" and t.data_ptr() == staged[id(root), name], name
        calls.append(module)
        return fully_shard(module, **kwargs)

    fsdp.fully_shard = watched
    a = whole(student, ids, attention_of=(0, 2))
    b = sharded(student, ids, attention_of=(0, 2))
    c = kept(student, ids, attention_of=(0, 2))
    fsdp.fully_shard = fully_shard
    assert sharded.sharded and kept.sharded
    assert len(calls) == 2 * (teacher.config.num_hidden_layers + 1)  # each layer, then the root, of both
    assert torch.allclose(a.logits, c.logits, atol=1e-5), (a.logits - c.logits).abs().max()
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
