"""Run by tests/recipes/test_launch.py under ``torch.distributed.run`` (2 gloo processes): ``recipes.launch.rank0s``
gives every process the main process's value (the layers a student keeps, computed on each rank, can differ);
prints "agreed" on success."""

import torch.distributed as dist

from linearize.recipes.launch import rank0s


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mine = ([rank, 10 + rank], {"chosen": [rank], "score": f"rank {rank}"})
    got = rank0s(mine)
    assert got == ([0, 10], {"chosen": [0], "score": "rank 0"}), (rank, got)
    dist.destroy_process_group()
    assert rank0s(mine) == mine  # no process group: the value itself
    if rank == 0:
        print("agreed")


if __name__ == "__main__":
    main()
