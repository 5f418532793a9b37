"""Prefill and decode throughput and memory of a student against its teacher.

Each (model, path) pair is timed over batch sizes and generated lengths. Paths:

- ``generate``: transformers' own ``model.generate()`` loop (dynamic cache; the student's recurrent slots;
  ``fast_decoding=False`` for a student, whose ``generate()`` would otherwise take the fast decoder);
- ``static``: ``generate(cache_implementation="static")``, the fastest softmax path transformers
  offers (on CUDA it compiles the forward for a static cache);
- ``fast``: ``linearize.fast`` (static state buffers, the decode step as one CUDA graph;
  ``fast+compile`` with the step compiled by ``torch.compile``).

For each size: a random prompt of ``prompt_len`` tokens, one untimed warm-up at the same size (for
the fast path a short one: its buffers and graph are made per call and timed apart from the
decode loop), then the timed run generating exactly ``new_tokens`` tokens. Prefill is timed alone; decode tokens/s counts the new tokens over the decode time.
Memory: the bytes the cache/state holds and, on CUDA, the peak allocated during the run and what was
already allocated when it began (``base_bytes``: the weights and anything an earlier size left; the
run's own growth is the difference; garbage is collected first). A size
that runs out of memory is recorded and ends that pair's sweep over larger batches.

Bandwidth floor (CUDA, student rows): a decode step must read at least every weight it uses and its whole
state, so no step can be faster than ``(weight bytes + state bytes) / bandwidth``. The weight bytes are
every parameter less the input embedding when the head does not share it (a step gathers only a few of
its rows); the bandwidth is a device-to-device copy's, measured once per sweep in the same process
(bytes read plus bytes written over its time). ``floor_ms`` is that bound for the row's batch; the
row's ``ms_per_step`` over it says how far the step is from what memory allows.
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import asdict, dataclass

import torch

from ..cache import LinearizeCache, cache_keyword, cache_nbytes
from ..decode.route import plain_loop
from ..errors import LinearizeError

PATHS = ("generate", "static", "fast")


@dataclass
class DecodeRow:
    model: str
    path: str
    batch: int
    prompt_len: int
    new_tokens: int
    prefill_tok_s: float | None
    decode_tok_s: float | None
    ms_per_step: float | None
    cache_bytes: int | None
    peak_bytes: int | None
    note: str = ""
    base_bytes: int | None = None
    phase_peaks: dict | None = None  # fast path on CUDA: peak bytes at the end of prefill, cache, setup, decode
    floor_ms: float | None = None  # CUDA, students: (weight bytes + state bytes) / copy bandwidth (module doc)
    bandwidth_gb_s: float | None = None  # the copy bandwidth that floor used, GB/s


def step_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter (each storage once), less the input embedding
    when the output head does not share it (a step gathers only the new tokens' rows of it)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if embed is not None and (head is None or head.weight.data_ptr() != embed.weight.data_ptr()):
        total -= embed.weight.numel() * embed.weight.element_size()
    return total


def copy_bandwidth(device, nbytes: int = 1 << 30, repeats: int = 10) -> float | None:
    """Bytes/s of a device-to-device copy of ``nbytes`` (read plus written, over the median of ``repeats``
    timed copies after one untimed); None off CUDA or where the buffers do not fit."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    try:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / sorted(times)[len(times) // 2]


def floor_ms(weight_bytes: int, state_bytes: int | None, bandwidth: float | None) -> float | None:
    """The bandwidth floor of one decode step in ms (module doc); None without a bandwidth or a state size."""
    if not bandwidth or state_bytes is None:
        return None
    return 1000 * (weight_bytes + state_bytes) / bandwidth


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cache_for(model):
    return LinearizeCache(model) if getattr(model.config, "linearize", None) else None


def _generate_run(model, prompt, new_tokens, path, prefill_chunk: int | None = None):
    """(prefill seconds, decode seconds, cache bytes) through generate(). ``prefill_chunk``: the prompt goes
    in ``prefill_chunk`` tokens at a time (transformers' ``prefill_chunk_size``), so a prefill's activations
    are those of one chunk for every sequence, not the whole prompt's: what lets a long context's cache
    fill most of the memory."""
    device = prompt.device
    kw = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
              return_dict_in_generate=True)
    if prefill_chunk:
        kw["prefill_chunk_size"] = prefill_chunk
    if path == "static":
        if getattr(model.config, "linearize", None):
            raise LinearizeError("the static path is for softmax teachers; students use 'fast'")
        kw["cache_implementation"] = "static"
    else:
        kw[cache_keyword(model)] = _cache_for(model)
    _sync(device)
    start = time.perf_counter()
    _prefill(model, prompt, prefill_chunk)  # its cache is dropped: generate() below makes its own
    _sync(device)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    out = model.generate(prompt, **plain_loop(model), **kw)  # transformers' own loop, which this path times
    _sync(device)
    total = time.perf_counter() - start
    cache = out.cache if cache_keyword(model) == "cache" else out.past_key_values
    return prefill, max(total - prefill, 1e-9), cache_nbytes(cache), None


def _prefill(model, prompt, chunk: int | None):
    """The prompt's forward alone, into a fresh cache, whole or ``chunk`` tokens at a time; returns the cache."""
    key = cache_keyword(model)
    cache = _cache_for(model)  # None for a teacher: its forward makes its own
    for start in range(0, prompt.shape[1], chunk or prompt.shape[1]):
        out = model(prompt[:, start:start + (chunk or prompt.shape[1])], **{key: cache}, use_cache=True,
                    logits_to_keep=1)
        cache = getattr(out, "cache", None)
        cache = out.past_key_values if cache is None else cache
    return cache


def _fast_run(model, prompt, new_tokens, decoder, warmup: bool = False):
    if warmup:  # buffers and the graph are made per call: a short run warms the allocator and kernels
        decoder.generate(prompt, max_new_tokens=min(new_tokens, 8), pad_token_id=0)
        return None
    decoder.generate(prompt, max_new_tokens=new_tokens, pad_token_id=0)
    t = decoder.timings
    # the first token comes from the prefill's logits and the first steps run before the graph
    # is captured; the decoding time covers the rest
    per_step = t["decode_s"] / max(t["decode_steps"], 1)
    peaks = {k[len("peak_"):-len("_bytes")]: v for k, v in t.items() if k.startswith("peak_")}
    return t["prefill_s"], per_step * new_tokens, t["state_bytes"], peaks or None


@torch.no_grad()
def measure(model, label: str, batch: int, prompt_len: int, new_tokens: int, path: str = "generate",
            seed: int = 0, compile: bool = False, prefill_batch: int | None = None,
            fuse_projections: bool = True, prefill_chunk: int | None = None) -> DecodeRow:
    if path not in PATHS:
        raise LinearizeError(f"unknown path {path!r}: expected one of {', '.join(PATHS)}")
    device = next(model.parameters()).device
    prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len),
                           generator=torch.Generator().manual_seed(seed)).to(device)
    try:
        if path == "fast":
            from ..decode import FastDecoder

            decoder = FastDecoder(model, compile=compile, prefill_batch=prefill_batch,
                                  fuse_projections=fuse_projections)
            run = lambda: _fast_run(model, prompt, new_tokens, decoder)  # noqa: E731
            _fast_run(model, prompt, new_tokens, decoder, warmup=True)
        else:
            run = lambda: _generate_run(model, prompt, new_tokens, path, prefill_chunk)  # noqa: E731
            run()  # warm-up at this size: compilation (the static path's cache length), allocator
        base = None
        if device.type == "cuda":
            gc.collect()  # what an earlier size left in reference cycles must not count here
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        prefill, decode, held, phase_peaks = run()
    except torch.OutOfMemoryError:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return DecodeRow(label, path, batch, prompt_len, new_tokens, None, None, None, None, None, "out of memory")
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return DecodeRow(label, path, batch, prompt_len, new_tokens, batch * prompt_len / prefill,
                     batch * new_tokens / decode, 1000 * decode / new_tokens, held, peak, base_bytes=base,
                     phase_peaks=phase_peaks)


def sweep(entries, batches, lengths, prompt_len: int = 128, compile: bool = False,
          prefill_batch: int | None = None, fuse_projections: bool = True,
          prefill_chunk: int | None = None) -> list[DecodeRow]:
    """``entries``: (label, model, path) triples. Rows are printed as JSON lines as they come.
    ``compile``: the fast path compiles its decode step (its row's path reads ``fast+compile``).
    ``prefill_chunk``: the generate and static paths prefill that many tokens at a time (``_generate_run``).
    ``fuse_projections=False``: the fast path keeps q/k/v and gate/up apart (path ``...+unfused``)."""
    rows = []
    bandwidth = None
    if any(getattr(m.config, "linearize", None) for _, m, _ in entries):
        bandwidth = copy_bandwidth(next(entries[0][1].parameters()).device)
    for label, model, path in entries:
        weights = step_weight_bytes(model) if getattr(model.config, "linearize", None) else None
        for n in lengths:
            for b in batches:
                row = measure(model, label, b, prompt_len, n, path, compile=compile and path == "fast",
                              prefill_batch=prefill_batch, fuse_projections=fuse_projections,
                              prefill_chunk=prefill_chunk)
                if weights is not None and bandwidth and not row.note:
                    row.floor_ms, row.bandwidth_gb_s = floor_ms(weights, row.cache_bytes, bandwidth), bandwidth / 1e9
                if compile and path == "fast":
                    row.path = "fast+compile"
                if not fuse_projections and path == "fast":
                    row.path += "+unfused"
                rows.append(row)
                print(json.dumps(asdict(row)), flush=True)
                if row.note:
                    break  # larger batches will not fit either
    return rows


def table(rows: list[DecodeRow]) -> str:
    lines = ["| model | path | batch | new tokens | prefill tok/s | decode tok/s | ms/step | floor ms | cache MB "
             "| peak MB | base MB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x, f: "—" if x is None else format(x, f)  # noqa: E731
    for r in rows:
        lines.append(f"| {r.model} | {r.path} | {r.batch} | {r.new_tokens} | {fmt(r.prefill_tok_s, ',.0f')} | "
                     f"{fmt(r.decode_tok_s, ',.1f')} | {fmt(r.ms_per_step, '.2f')} | {fmt(r.floor_ms, '.2f')} | "
                     f"{fmt(None if r.cache_bytes is None else r.cache_bytes / 2**20, '.2f')} | "
                     f"{fmt(None if r.peak_bytes is None else r.peak_bytes / 2**20, '.0f')} | "
                     f"{fmt(None if r.base_bytes is None else r.base_bytes / 2**20, '.0f')} |" + (f" {r.note}" if r.note else ""))
    return "\n".join(lines)


def plots(rows: list[DecodeRow], out_dir) -> list:
    """``tok_s_vs_batch.png`` (decode tokens/s against batch, one line per model/path and length)
    and ``memory_vs_length.png`` (peak memory, else cache bytes, against generated length, per
    model/path at the smallest batch). Needs matplotlib."""
    from pathlib import Path

    from ..eval.plots import _pyplot, _save

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ok = [r for r in rows if r.decode_tok_s is not None]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for key in sorted({(r.model, r.path, r.new_tokens) for r in ok}):
        pts = sorted((r.batch, r.decode_tok_s) for r in ok if (r.model, r.path, r.new_tokens) == key)
        ax.plot(*zip(*pts), marker="o", label=f"{key[0]} {key[1]} ({key[2]} new)")
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="decode tokens/s")
    paths = [_save(plt, fig, ax, out_dir / "tok_s_vs_batch.png")]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for key in sorted({(r.model, r.path) for r in ok}):
        mine = [r for r in ok if (r.model, r.path) == key]
        b = min(r.batch for r in mine)
        pts = sorted((r.new_tokens, (r.peak_bytes if r.peak_bytes is not None else r.cache_bytes) / 2**20)
                     for r in mine if r.batch == b)
        ax.plot(*zip(*pts), marker="o", label=f"{key[0]} {key[1]} (batch {b})")
    ax.set(xscale="log", xlabel="generated tokens", ylabel="peak MB (CUDA) / cache MB (CPU)")
    paths.append(_save(plt, fig, ax, out_dir / "memory_vs_length.png"))
    return paths
