"""Run by tests/recipes/test_launch.py: LoLCATs stage 2's merge under FSDP2 (``lora.merged_from_shards``) on 2 gloo
processes against one unsharded process's ``merge_and_unload``. ``python fsdp_lora_merge.py DIR`` writes the
reference to DIR; under ``torch.distributed.run`` (2 processes) the main process compares and prints "merged
alike", the other checks that it kept no copy."""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers.py
from helpers import tiny_config  # noqa: E402

import linearize  # noqa: E402
from linearize.recipes.lora import add_lora, merged_from_shards  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def lora_student():
    torch.manual_seed(0)
    model = linearize.convert(AutoModelForCausalLM.from_config(tiny_config("llama")),
                              {"kind": "lolcats", "window": 4, "feature_dim": 8})
    peft_model = add_lora(model, 4, 8, TARGETS)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero, where merging changes nothing
            torch.nn.init.normal_(p, std=0.05)
    return peft_model


def main(folder: Path) -> None:
    if "RANK" not in os.environ:
        torch.save(lora_student().merge_and_unload().state_dict(), folder / "merged.pt")
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    peft_model = lora_student()
    base = peft_model.get_base_model()
    for layer in base.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(base, mesh=mesh)
    merged = merged_from_shards(peft_model, 4, 8, TARGETS)
    if dist.get_rank() == 0:
        reference = torch.load(folder / "merged.pt")
        state = merged.state_dict()
        assert state.keys() == reference.keys(), sorted(set(state) ^ set(reference))[:4]
        assert not any("lora" in name for name in state)
        for name, t in reference.items():
            assert torch.allclose(state[name], t, rtol=1e-6, atol=1e-7), name
        q = "model.layers.0.self_attn.q_proj.weight"
        assert not torch.allclose(state[q], AutoModelForCausalLM.from_config(tiny_config("llama")).state_dict()[q])
        print("merged alike")
    else:
        assert merged is base  # sharded as it was: no CPU copy on the other ranks
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
