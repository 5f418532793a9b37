"""Ready-made ``accelerate launch`` configurations for the recipes on several GPUs.

``python -m linearize.recipes.launch ddp|fsdp`` prints the path of one, for
``accelerate launch --config_file PATH -m linearize <recipe> ...``; ``torchrun --nproc_per_node N
-m linearize <recipe> ...`` is the same as ``ddp``. ``--batch-size`` is per GPU: N GPUs train on N
times the batch of one, so give one GPU N x the batch (or N x ``--grad-accum``) to compare.
"""

from __future__ import annotations

import os
from pathlib import Path

CONFIGS = {p.stem: p for p in sorted(Path(__file__).parent.glob("*.yaml"))}


def config_path(name: str) -> Path:
    from ...errors import LinearizeError

    if name not in CONFIGS:
        raise LinearizeError(f"no launch configuration {name!r}; choose from {', '.join(CONFIGS)}")
    return CONFIGS[name]


def is_main_process() -> bool:
    """True in a single-process run and on global rank 0 of a torchrun/accelerate launch: the one
    process that writes files (two ranks writing one checkpoint would corrupt it)."""
    return int(os.environ.get("RANK", "0")) == 0


def world_size() -> int:
    """How many processes a torchrun/accelerate launch started (1 otherwise)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def bind_process_gpu() -> None:
    """Make this process's GPU (``LOCAL_RANK`` under torchrun / accelerate launch) the current CUDA device.
    The recipes load the teacher there and measure it before the Trainer would make it current; until then
    the current device is GPU 0, where kernels launched for another GPU's tensors fail (Triton: "Pointer
    argument cannot be accessed"). Nothing without CUDA or outside a launch."""
    import torch

    local = os.environ.get("LOCAL_RANK")
    if local is not None and local.isdigit() and torch.cuda.is_available() and int(local) < torch.cuda.device_count():
        torch.cuda.set_device(int(local))


def under_fsdp() -> bool:
    """Launched by ``accelerate launch`` with an FSDP configuration (``fsdp.yaml`` here)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true", "yes")


def rank0s(value):
    """``value`` as the main process has it, on every process of a torch.distributed run (``value`` itself
    otherwise). For what each process computes and all must agree on, such as the layers a student keeps
    as softmax: scored on each GPU, a near tie can fall either way, and ranks whose models differ cannot
    train together. Every process calls it (the broadcast is collective)."""
    import torch

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def peak_gpu_memory() -> dict:
    """This process's peak allocated CUDA memory, ``{"peak_gpu_bytes": n}``, its peak reserved by the caching
    allocator (``peak_reserved_bytes``) and how often the allocator had to free its cache and retry
    (``alloc_retries``: a run near the card's memory pays a synchronisation each time), with every
    process's peak (``peak_gpu_bytes_per_rank``, by rank) and retries (``alloc_retries_per_rank``) under
    torch.distributed; ``{}`` without CUDA. Every process of a launch calls it (the gather is collective)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    info = {"peak_gpu_bytes": torch.cuda.max_memory_allocated(), "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
            "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0)}
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        mine = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(mine, (info["peak_gpu_bytes"], info["alloc_retries"]))
        info["peak_gpu_bytes_per_rank"] = [peak for peak, _ in mine]
        info["alloc_retries_per_rank"] = [retries for _, retries in mine]
    return info
