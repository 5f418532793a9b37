"""Prefill throughput: a prompt's forward with the cache decoding starts from, student against teacher.

    linearize bench CHECKPOINT --prefill 1x1024 32x1024 256x1024 1x8192 32x8192 1x32768 32x32768

Each (model, path) is timed at every batch x prompt-length shape in one run, shape by shape (all of
them at one shape, then the next, so each ratio compares passes timed close together): a random prompt,
``warmup`` untimed passes at that shape (Triton compiles its kernels for each new shape class,
cuDNN/flash pick theirs, the allocator grows), then timed passes (at least one, at most
``repeats``, until ``budget_s`` seconds), of which the median counts; tokens/s = batch x length /
that time, with the peak memory on CUDA. Every pass computes the logits of the last token only
and fills the cache the first decode step would read, as ``linearize.fast``'s prefill does; q/k/v
and a gated MLP's gate/up are computed as one product each (``linearize.decode.fused``) for both models.

Paths. The teacher: its forward through ``transformers`` with a ``DynamicCache`` and each
requested attention implementation (``sdpa``; ``flash_attention_2`` where flash-attn is
installed; an unavailable one leaves a row with a note). The student: ``kernels`` (its spec's
backend, the Triton kernels on CUDA) and ``torch`` (the PyTorch chunked form, for a before/after
in the same run). The ratio column divides by the teacher's fastest path at the shape. A shape
that runs out of memory is recorded as such and the sweep goes on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

TEACHER_PATHS = ("sdpa", "flash_attention_2", "eager")
STUDENT_PATHS = ("kernels", "torch")


@dataclass
class PrefillRow:
    model: str
    path: str
    batch: int
    prompt_len: int
    tokens_per_s: float | None
    ms: float | None
    peak_bytes: int | None
    ratio_to_teacher: float | None = None
    note: str = ""
    ms_each: list[float] | None = None  # every timed pass (the median is ``ms``): a slow mode shows in them


@contextlib.contextmanager
def student_backend(model, backend: str | None):
    """Every converted layer's spec ``backend`` set to ``backend`` inside the block (None: untouched)."""
    from ..convert import mixers

    layers = list(mixers(model).values()) if backend else []
    saved = [m.spec for m in layers]
    for m in layers:
        m.spec = dataclasses.replace(m.spec, backend=backend)
    try:
        yield
    finally:
        for m, spec in zip(layers, saved):
            m.spec = spec


def _set_attention(model, implementation: str) -> str | None:
    """Switch a teacher to ``implementation``; a note when it cannot run here."""
    if getattr(model.config, "_attn_implementation", None) == implementation:
        return None
    try:
        model.set_attn_implementation(implementation)
    except Exception as e:  # flash-attn not installed, or not for this model/device
        return f"{implementation} unavailable: {str(e).splitlines()[0][:160]}"
    if getattr(model.config, "_attn_implementation", None) != implementation:
        return f"{implementation} unavailable for {type(model).__name__}"
    return None


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def prefill_once(model, ids) -> None:
    """One prefill as the fast decoder runs it: the last token's logits and a filled cache."""
    from transformers import DynamicCache

    from ..cache import LinearizeCache, cache_keyword

    cache = LinearizeCache(model) if getattr(model.config, "linearize", None) else DynamicCache(config=model.config)
    model(ids, **{cache_keyword(model): cache}, use_cache=True, logits_to_keep=1)


def measure(model, label: str, path: str, batch: int, prompt_len: int, *, warmup: int = 2, repeats: int = 5,
            budget_s: float = 3.0, seed: int = 0) -> PrefillRow:
    from ..decode.fused import fused_projections

    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len),
                        generator=torch.Generator().manual_seed(seed)).to(device)
    times = []
    try:
        with fused_projections(model):
            for _ in range(warmup):
                prefill_once(model, ids)
            _sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            while len(times) < max(repeats, 1):
                start = time.perf_counter()
                prefill_once(model, ids)
                _sync(device)
                times.append(time.perf_counter() - start)
                if sum(times) > budget_s:
                    break
    except torch.OutOfMemoryError:
        return PrefillRow(label, path, batch, prompt_len, None, None, None, note="out of memory")
    finally:
        del ids
        if device.type == "cuda":
            torch.cuda.empty_cache()
    seconds = statistics.median(times)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return PrefillRow(label, path, batch, prompt_len, batch * prompt_len / seconds, 1000 * seconds, peak,
                      ms_each=[round(1000 * t, 3) for t in times])


def sweep(student, teacher, shapes, *, teacher_paths=("sdpa", "flash_attention_2"), student_paths=("kernels",),
          warmup: int = 2, repeats: int = 5, budget_s: float = 3.0, report=None) -> list[PrefillRow]:
    """Rows for every (model, path) at every ``(batch, prompt_len)`` of ``shapes``, printed as JSON
    lines as they come (``report`` gets the rows so far after each); ``teacher`` may be None.

    Shape by shape: every (model, path) runs at one shape before the next shape starts, so a ratio
    compares passes timed minutes apart at most, not a whole sweep apart (a short prefill is
    host-bound, and a shared host's speed drifts). Rows come back in (model, path, shape) order."""
    entries = []
    if teacher is not None:
        entries += [("teacher", teacher, p) for p in teacher_paths]
    if student is not None:
        entries += [("student", student, p) for p in student_paths]
    unavailable = {}  # teacher paths that cannot run here: their notes
    timed = {}
    for b, t in shapes:
        for i, (label, model, path) in enumerate(entries):
            if label == "teacher" and i not in unavailable:
                note = _set_attention(model, path)
                if note:
                    unavailable[i] = note
            note = unavailable.get(i)
            if note:
                row = PrefillRow(label, path, b, t, None, None, None, note=note)
            else:
                backend = "torch" if label == "student" and path == "torch" else None
                with student_backend(model, backend):
                    row = measure(model, label, path, b, t, warmup=warmup, repeats=repeats, budget_s=budget_s)
            timed[i, (b, t)] = row
            print(json.dumps(asdict(row)), flush=True)
            if report is not None:
                report(with_ratios(_in_order(timed, entries, shapes)))
    return with_ratios(_in_order(timed, entries, shapes))


def _in_order(timed: dict, entries, shapes) -> list[PrefillRow]:
    """The rows timed so far, by (model, path) and then by shape."""
    return [timed[i, shape] for i in range(len(entries)) for shape in shapes if (i, shape) in timed]


def with_ratios(rows: list[PrefillRow]) -> list[PrefillRow]:
    """Each row's tokens/s over the teacher's fastest path at its shape."""
    best = {}
    for r in rows:
        if r.model == "teacher" and r.tokens_per_s:
            key = (r.batch, r.prompt_len)
            best[key] = max(best.get(key, 0.0), r.tokens_per_s)
    for r in rows:
        base = best.get((r.batch, r.prompt_len))
        r.ratio_to_teacher = r.tokens_per_s / base if r.tokens_per_s and base else None
    return rows


def table(rows: list[PrefillRow]) -> str:
    lines = ["| model | path | batch x prompt | prefill tok/s | ms | peak GB | vs teacher |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        tok = "—" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}"
        ms = "—" if r.ms is None else f"{r.ms:.1f}"
        peak = "—" if r.peak_bytes is None else f"{r.peak_bytes / 2**30:.2f}"
        ratio = "—" if r.ratio_to_teacher is None else f"{r.ratio_to_teacher:.2f}x"
        lines.append(f"| {r.model} | {r.path} | {r.batch}x{r.prompt_len} | {tok} | {ms} | {peak} | {ratio} |"
                     + (f" {r.note}" if r.note else ""))
    return "\n".join(lines)
