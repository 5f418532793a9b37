"""Reading ``torch.profiler`` results: kernels (or, on the CPU, operators) by time, the GPU's busy share of a span,
the host's CUDA runtime calls. Used by ``linearize.bench.profile`` (one step built for it) and by the training
engine's ``--profile-steps`` (steps of a real run, under any launcher)."""

from __future__ import annotations

import torch


def activities(device: torch.device):
    """The profiler's activities on ``device``: the host's, and the GPU's kernels on CUDA."""
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def kernel_table(prof, device: torch.device, steps: int, top: int) -> dict:
    """Kernels (CUDA) or operators (CPU) grouped by name: per-step time (us) and launches, largest first."""
    cuda = device.type == "cuda"
    rows = []
    for e in prof.key_averages():
        if cuda:
            t = getattr(e, "self_device_time_total", None)
            t = e.self_cuda_time_total if t is None else t
            is_kernel = getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
            if not is_kernel or t <= 0:
                continue
        else:
            t = e.self_cpu_time_total
            if not e.key.startswith("aten::") or t <= 0:
                continue
        rows.append({"name": e.key, "us_per_step": t / steps, "launches_per_step": e.count / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    launches = sum(r["launches_per_step"] for r in rows)
    return {"unit": "kernel" if cuda else "operator", "steps": steps, "us_per_step": total,
            "launches_per_step": launches, "top": rows[:top]}


def runtime_calls(prof, steps: int) -> list[dict]:
    """The host's CUDA runtime / driver calls per step (cudaLaunchKernel, cuLaunchKernelEx,
    cudaStreamSynchronize, cudaMemcpyAsync, ...): count and host time, largest first."""
    rows = [{"name": e.key, "us_per_step": e.self_cpu_time_total / steps, "calls_per_step": e.count / steps}
            for e in prof.key_averages()
            if e.key.startswith(("cuda", "cu")) and getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def gpu_busy(prof) -> tuple[float, float]:
    """(busy, span) in us over the profiled steps: the union of the kernels' device intervals, and
    the time from the first kernel's start to the last one's end."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        return 0.0, 0.0
    busy, (cur_start, cur_end) = 0.0, spans[0]
    for start, end in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    return busy, spans[-1][1] - spans[0][0]


def table_lines(unit: str, top: list[dict]) -> list[str]:
    """A markdown table of ``kernel_table``'s rows: name, time and launches a step."""
    return [f"| {unit} | us/step | launches/step |", "|---|---|---|",
            *(f"| {r['name'][:90]} | {r['us_per_step']:.1f} | {r['launches_per_step']:.1f} |" for r in top)]
