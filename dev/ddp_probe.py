"""Where a data-parallel SUPRA step loses time (issue #23): ms per training step of the SUPRA student
(every weight training, bf16, batch 8 x 1024 per GPU, AdamW, clipping) in variants.

    python dev/ddp_probe.py TEACHER                         # one process: the baseline
    torchrun --standalone --nproc_per_node 2 dev/ddp_probe.py TEACHER [--profile]

Each variant runs in turn, ``--rounds`` times, every step with the recipe's finiteness check (a host
sync): ``alone`` (no DDP; under torchrun each process trains its own copy, which shows what two busy
GPUs cost each other), ``*-nogc`` (Python's garbage collector off), ``ddp`` (as the Trainer wraps it) and
its options (bucket size, gradient_as_bucket_view, static_graph), ``*-normitem`` (the gradient norm
read back every step, as the Trainer does), ``graphed`` (CUDA-graph replays,
``linearize.graphed``; under torchrun with ``recipes.engine.average_gradients`` after each backward).
Rank 0 prints medians and 90th percentiles of the step times (ms) as one JSON line; ``--profile`` adds
the top kernels of three ``ddp`` steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch
import torch.distributed as dist

import linearize
from linearize import convert
from linearize.graphed import GraphedLoss
from linearize.recipes.engine import average_gradients, next_token_loss


def build(teacher: str, device):
    model, _ = linearize.load_teacher(teacher, device=device)
    model = convert(model, {"kind": "supra"}, inplace=True)
    model.train()
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def timed(step, warm: int, runs: int) -> dict:
    """Median and 90th percentile of ``runs`` steps' wall times (ms), each step synchronised."""
    for _ in range(warm):
        step()
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return {"median": round(times[len(times) // 2], 1), "p90": round(times[int(len(times) * 0.9)], 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("teacher")
    ap.add_argument("--warm", type=int, default=15)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=1, help="the variants run in turn this many times")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl", device_id=device)
    torch.manual_seed(rank)
    model = build(args.teacher, device)
    vocab = model.config.vocab_size
    batch = {"input_ids": torch.randint(0, vocab, (8, 1024), device=device)}
    batch["labels"] = batch["input_ids"].clone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.95), fused=True)

    def stepper(wrapped=None, finite=False, graphed=None, average=False, norm_item=False):
        def step():
            if graphed is not None:
                loss = graphed(batch["input_ids"], batch["labels"])
            else:
                with torch.autocast("cuda", torch.bfloat16):
                    loss = next_token_loss(wrapped, batch)
            if finite:
                bool(torch.isfinite(loss.detach()))
            loss.backward()
            if average:
                average_gradients(model)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if norm_item:  # the Trainer reads the gradient norm back every step (a host sync)
                float(norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    def variants():
        yield "alone", stepper(model, finite=True)
        yield "alone-normitem", stepper(model, finite=True, norm_item=True)
        gc.disable()
        yield "alone-nogc", stepper(model, finite=True)
        gc.enable()
        if world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP
            for name, kw in (("ddp", {}), ("ddp-bucket100", dict(bucket_cap_mb=100)),
                             ("ddp-view-static", dict(gradient_as_bucket_view=True, static_graph=True)),
                             ("ddp-b100-view", dict(bucket_cap_mb=100, gradient_as_bucket_view=True))):
                wrapped = DDP(model, device_ids=[device.index], **kw)
                yield name, stepper(wrapped, finite=True)
                if name == "ddp":
                    yield "ddp-normitem", stepper(wrapped, finite=True, norm_item=True)
                    gc.disable()
                    yield "ddp-nogc", stepper(wrapped, finite=True)
                    gc.enable()
                del wrapped
                gc.collect()
        graphed = GraphedLoss(model, torch.bfloat16)
        yield "graphed" + ("+average" if world > 1 else ""), stepper(graphed=graphed, finite=True, average=world > 1)
        del graphed
        gc.collect()

    results: dict[str, list] = {}
    for _ in range(args.rounds):
        for name, step in variants():
            results.setdefault(name, []).append(timed(step, args.warm, args.runs))
    if world > 1:
        t = torch.randn(model.num_parameters(), dtype=torch.bfloat16, device=device)
        results["allreduce-all-grads"] = [timed(lambda: dist.all_reduce(t), 3, 10)]
    if args.profile and world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.profiler import ProfilerActivity, profile
        step = stepper(DDP(model, device_ids=[device.index]), finite=True)
        for _ in range(5):
            step()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        if rank == 0:
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    if rank == 0:
        tokens = 8 * 1024 * world
        print(json.dumps({"world": world, "device": torch.cuda.get_device_name(), "ms_per_step": results,
                          "tokens_per_s": {k: [round(tokens / r["median"] * 1e3) for r in v] for k, v in results.items()
                                           if not k.startswith("allreduce")}}))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
