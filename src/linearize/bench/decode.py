"""Prefill and decode throughput and memory of a student against its teacher, through ``generate()``.

For each model, batch size and generated length: a random prompt of ``prompt_len`` tokens, one
warm-up, then the timed ``generate`` (greedy, exactly ``new_tokens`` tokens). Prefill is timed
alone (one forward that fills the cache). Memory is the cache's bytes after generation and, on
CUDA, the peak allocated during it. A size that runs out of memory is recorded and ends that
model's sweep over larger batches.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import torch

from ..cache import LinearizeCache, cache_nbytes


@dataclass
class DecodeRow:
    model: str
    batch: int
    prompt_len: int
    new_tokens: int
    prefill_tok_s: float | None
    decode_tok_s: float | None
    ms_per_step: float | None
    cache_bytes: int | None
    peak_bytes: int | None
    note: str = ""


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cache_for(model):
    return LinearizeCache(model) if getattr(model.config, "linearize", None) else None


@torch.no_grad()
def measure(model, label: str, batch: int, prompt_len: int, new_tokens: int, seed: int = 0) -> DecodeRow:
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(seed)).to(device)
    kw = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
              return_dict_in_generate=True)
    try:
        model.generate(prompt[:, :8], do_sample=False, max_new_tokens=2, pad_token_id=0)  # warm-up
        _sync(device)
        start = time.perf_counter()
        model(prompt, past_key_values=_cache_for(model), use_cache=True)
        _sync(device)
        prefill = time.perf_counter() - start
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        out = model.generate(prompt, past_key_values=_cache_for(model), **kw)
        _sync(device)
        total = time.perf_counter() - start
    except torch.OutOfMemoryError:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return DecodeRow(label, batch, prompt_len, new_tokens, None, None, None, None, None, "out of memory")
    decode = max(total - prefill, 1e-9)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return DecodeRow(label, batch, prompt_len, new_tokens, batch * prompt_len / prefill,
                     batch * new_tokens / decode, 1000 * decode / new_tokens, cache_nbytes(out.past_key_values), peak)


def sweep(models: dict, batches, lengths, prompt_len: int = 128) -> list[DecodeRow]:
    rows = []
    for label, model in models.items():
        for n in lengths:
            for b in batches:
                row = measure(model, label, b, prompt_len, n)
                rows.append(row)
                print(json.dumps(asdict(row)), flush=True)
                if row.note:
                    break  # larger batches will not fit either
    return rows


def table(rows: list[DecodeRow]) -> str:
    lines = ["| model | batch | new tokens | prefill tok/s | decode tok/s | ms/step | cache MB | peak MB |",
             "|---|---|---|---|---|---|---|---|"]
    fmt = lambda x, f: "—" if x is None else format(x, f)  # noqa: E731
    for r in rows:
        lines.append(f"| {r.model} | {r.batch} | {r.new_tokens} | {fmt(r.prefill_tok_s, ',.0f')} | "
                     f"{fmt(r.decode_tok_s, ',.1f')} | {fmt(r.ms_per_step, '.1f')} | "
                     f"{fmt(None if r.cache_bytes is None else r.cache_bytes / 2**20, '.2f')} | "
                     f"{fmt(None if r.peak_bytes is None else r.peak_bytes / 2**20, '.0f')} |" + (f" {r.note}" if r.note else ""))
    return "\n".join(lines)
