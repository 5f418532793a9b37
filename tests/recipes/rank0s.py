"""Run by tests/recipes/test_launch.py under ``torch.distributed.run`` (2 gloo processes): ``recipes.launch.rank0s``
gives every process the main process's value (the layers a student keeps, computed on each rank, can differ), and
``peak_gpu_memory`` gathers every rank's peak and allocator retries (CUDA's counters stand in); prints "agreed"."""

import torch
import torch.distributed as dist

from linearize.recipes.launch import peak_gpu_memory, rank0s


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mine = ([rank, 10 + rank], {"chosen": [rank], "score": f"rank {rank}"})
    got = rank0s(mine)
    assert got == ([0, 10], {"chosen": [0], "score": "rank 0"}), (rank, got)
    torch.cuda.is_available = lambda: True
    torch.cuda.max_memory_allocated = lambda: 100 + rank
    torch.cuda.max_memory_reserved = lambda: 200 + rank
    torch.cuda.memory_stats = lambda: {"num_alloc_retries": 3 * rank}
    info = peak_gpu_memory()
    assert info == {"peak_gpu_bytes": 100 + rank, "peak_reserved_bytes": 200 + rank, "alloc_retries": 3 * rank,
                    "peak_gpu_bytes_per_rank": [100, 101], "alloc_retries_per_rank": [0, 3]}, info
    dist.destroy_process_group()
    assert rank0s(mine) == mine  # no process group: the value itself
    if rank == 0:
        print("agreed")


if __name__ == "__main__":
    main()
