"""Run by tests/recipes/test_launch.py: keep_softmax auto:K's greedy layer choice (``lolcats.recall_choice``) on a
student FSDP2 has sharded over 2 gloo processes against one unsharded process. ``python fsdp_recall_choice.py DIR``
writes the reference (the choice and every round's losses) to DIR; under ``torch.distributed.run`` (2 processes)
each process chooses on its shards and the main process compares and prints "chosen alike"."""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers.py
from helpers import tiny_config  # noqa: E402

import linearize  # noqa: E402
from linearize.recipes.lolcats import recall_choice  # noqa: E402


def student_and_task():
    torch.manual_seed(0)
    model = linearize.convert(AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=4)),
                              {"kind": "lolcats", "window": 4, "feature_dim": 8})
    for name, p in model.named_parameters():  # trained maps, not their initialisation: the layers differ
        if "feature_map" in name:
            torch.nn.init.normal_(p, std=0.3)
    ids = torch.randint(2, 90, (6, 24), generator=torch.Generator().manual_seed(1))
    ids[:, 16:] = ids[:, :8]  # a span copied from 16 tokens back
    labels = torch.full_like(ids, -100)
    labels[:, 17:] = ids[:, 17:]
    return model.eval(), ids, labels


def main(folder: Path) -> None:
    model, ids, labels = student_and_task()
    if "RANK" not in os.environ:
        torch.save(recall_choice(model, ids, labels, 2, batch_size=4), folder / "choice.pt")
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(ids[:1])  # the root's first forward, as training's would be
    chosen, rounds = recall_choice(model, ids, labels, 2, batch_size=4)
    assert type(model.lm_head.weight).__name__ == "DTensor"  # sharded again after the choice
    if dist.get_rank() == 0:
        ref_chosen, ref_rounds = torch.load(folder / "choice.pt")
        assert chosen == ref_chosen, (chosen, ref_chosen)
        for mine, ref in zip(rounds, ref_rounds, strict=True):
            assert mine["softmax"] == ref["softmax"] and mine["scores"].keys() == ref["scores"].keys()
            assert abs(mine["loss"] - ref["loss"]) < 1e-5, (mine["loss"], ref["loss"])
            assert all(abs(mine["scores"][i] - ref["scores"][i]) < 1e-5 for i in ref["scores"])
        assert len(set(ref_rounds[0]["scores"].values())) > 1  # the layers score apart: the choice means something
        print("chosen alike", chosen)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
