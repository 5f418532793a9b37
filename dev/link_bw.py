"""How fast the GPUs of one host exchange data through NCCL, as FSDP uses it.

    torchrun --standalone --nproc_per_node N dev/link_bw.py [--mib 512] [--reps 10]

Times ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` of bf16 tensors (each process's share
``--mib`` MiB) after a warm-up, and ``all_reduce`` of the same, between CUDA events with a barrier
before each; rank 0 prints one JSON line: per collective the median ms and the bus bandwidth (GB/s,
NCCL's convention: an all-gather or reduce-scatter moves (N - 1) / N of the whole tensor through each
link, an all-reduce twice that). Also what ``nvidia-smi topo -m`` says of the link, when it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    n = args.mib * 2**20 // 2
    share = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    whole = torch.empty(n * world, device="cuda", dtype=torch.bfloat16)
    calls = {"all_gather": lambda: dist.all_gather_into_tensor(whole, share),
             "reduce_scatter": lambda: dist.reduce_scatter_tensor(share, whole),
             "all_reduce": lambda: dist.all_reduce(whole)}
    out = {"world": world, "share_mib": args.mib}
    for name, call in calls.items():
        call()
        times = []
        for _ in range(args.reps):
            dist.barrier()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        ms = statistics.median(times)
        moved = whole.numel() * 2 * (world - 1) / world * (2 if name == "all_reduce" else 1)
        out[name] = {"ms": round(ms, 3), "bus_gb_s": round(moved / ms / 1e6, 1)}
    if rank == 0:
        try:
            out["topology"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                                             timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            out["topology"] = None
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
