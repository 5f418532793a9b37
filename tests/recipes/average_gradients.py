"""Run by tests/recipes/test_average_gradients.py under ``torch.distributed.run`` (2 gloo processes):
``recipes.engine.average_gradients`` leaves every process with the mean of the processes' gradients,
across buckets and dtypes, a missing gradient counting as zero, and the engine's Trainer averages a
graphed step's gradients (its weights stay equal across processes); prints "averaged" on success."""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers.py
from linearize.recipes.engine import average_gradients  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = nn.ModuleDict({"a": nn.Linear(7, 5), "b": nn.Linear(3, 3).to(torch.bfloat16), "c": nn.Linear(11, 2),
                           "frozen": nn.Linear(2, 2)})
    model["frozen"].requires_grad_(False)
    expected = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        if not p.requires_grad:
            continue
        values = [torch.arange(p.numel(), dtype=torch.float64).view_as(p) * (r + 1) + 10 * i for r in range(world)]
        if name == "c.bias":  # no gradient on rank 1: it counts as zero there
            values[1] = torch.zeros_like(values[1])
            if rank == 1:
                p.grad = None
                expected[name] = (sum(values) / world).to(p.dtype)
                continue
        p.grad = values[rank].to(p.dtype)
        expected[name] = (sum(values) / world).to(p.dtype)
    average_gradients(model, bucket_bytes=64)  # several buckets per dtype
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.dtype == p.dtype, name
            assert torch.equal(p.grad, expected[name]), (rank, name, p.grad, expected[name])
        else:
            assert p.grad is None, name
    trainer_steps_agree(rank, world)
    dist.barrier()
    if rank == 0:
        print("averaged")
    dist.destroy_process_group()


def trainer_steps_agree(rank: int, world: int) -> None:
    """The engine's Trainer with a ``graphed`` loss (here an eager stand-in that, like the CUDA-graph
    replay, calls the model without DDP's forward): after steps on different batches per process,
    every process holds the same weights."""
    import tempfile

    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from helpers import tiny_config
    from linearize.recipes.engine import RecipeTrainer, TrainConfig, next_token_loss, training_arguments

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    ids = torch.randint(0, model.config.vocab_size, (16, 12), generator=torch.Generator().manual_seed(1))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()}).with_format("torch")
    graphed = lambda input_ids, labels: model(input_ids=input_ids, labels=labels, use_cache=False).loss  # noqa: E731
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(output_dir=out, learning_rate=1e-2, max_steps=3, batch_size=2, eval_steps=100,
                          save_steps=100)
        trainer = RecipeTrainer(model=model, args=training_arguments(cfg, False), train_dataset=data,
                                loss_fn=next_token_loss, graphed=graphed)
        trainer.train()
    assert trainer._hooks_off, "the Trainer did not wrap the model in DDP"
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], g) for g in gathered), "the processes' weights differ"


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
