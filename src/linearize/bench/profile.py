"""Where a step's time goes: the kernels of one training step or of the decode steps, by time.

    python -m linearize.bench.profile train --model supra --shape 2x8192 [--teacher T] [--top 20] [--cuda-graph]
    python -m linearize.bench.profile decode CHECKPOINT [--batch 1] [--prompt-len 32] [--compile] [--tokens 16]
    python -m linearize.bench.profile prefill CHECKPOINT [--batch 1] [--prompt-len 1024] [--backend torch]

``train``: a full training step as ``linearize.bench.train`` times it (forward, backward, AdamW,
bf16 autocast over fp32 weights on CUDA), after warm-up steps, under ``torch.profiler``. Beside the
kernels it reports the step's wall time measured without the profiler, how long the GPU was busy
(the union of the kernels' intervals) against the profiled span, and the host's CUDA runtime calls
(launches, synchronisations, copies, allocations): a step whose wall time exceeds its kernel time
waits on the host, and these say whether on launches or on a synchronisation. ``--cuda-graph``
profiles the step as ``bench.train --cuda-graph`` times it: forward and backward replayed from
CUDA graphs (the LoLCATs stages through the recipe's graphed loss).
``decode``: ``linearize.fast`` decoding without the CUDA graph (a graph replays the same kernels;
the profiler sees them one by one only without it), optionally with the step compiled.
Prints the kernels grouped by name with their total device time and launch count, per step; on
the CPU it reports operators instead (no device kernels), which is what the tests check.
``prefill``: one prompt's prefill as ``linearize bench --prefill`` times it (last token's logits, a
filled cache, fused projections), with the launches per layer; ``--backend`` sets the converted
layers' backend (``torch``: the PyTorch forms, for the count before the kernels).
"""

from __future__ import annotations

import argparse
import json

import torch

from ..errors import LinearizeError
from ..profiling import activities, gpu_busy, kernel_table, runtime_calls, table_lines


def host_phases(model, optimizer, ids, cuda: bool, steps: int, sync, loss_fn=None, graphed=None) -> dict:
    """Host time per step of the forward, the backward and the optimizer, with no synchronisation in
    between: where the host is the bottleneck these add up to the wall time, and say which phase
    issues its work slowest (the backward's Python autograd functions run on autograd's own thread,
    where cProfile does not see them). ``drain``: what the GPU still had queued after that."""
    import time

    from .train import _step

    acc = dict.fromkeys(("forward", "backward", "optimizer", "drain"), 0.0)
    for _ in range(steps):
        marks = [time.perf_counter()]
        _step(model, optimizer, ids, cuda, graphed, marks=marks, loss_fn=loss_fn)
        sync()
        marks.append(time.perf_counter())
        for k, a, b in zip(acc, marks, marks[1:]):
            acc[k] += (b - a) / steps * 1e6
    return acc


def python_hotspots(step, steps: int, top: int, sync) -> list[dict]:
    """The Python functions that take the host's time in ``steps`` calls of ``step`` (cProfile, by own
    time per step, with their cumulative time): where a host-bound step spends it."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    sync()
    prof.disable()
    rows = []
    for (file, line, name), (_, calls, own, cum, _) in pstats.Stats(prof).stats.items():
        rows.append({"name": f"{name} ({file.split('site-packages/')[-1]}:{line})", "own_us_per_step": own / steps * 1e6,
                     "cum_us_per_step": cum / steps * 1e6, "calls_per_step": calls / steps})
    return sorted(rows, key=lambda r: -r["own_us_per_step"])[:top]


def profile_train(teacher, model_name: str, batch: int, length: int, steps: int = 2, warmup: int = 2,
                  top: int = 20, python_top: int = 0, cuda_graph: bool = False) -> dict:
    """``cuda_graph``: the step's forward and backward replayed from CUDA graphs (the first warm-up
    step captures); needs a CUDA device."""
    import time

    from torch.profiler import profile

    from .train import STAGES, _step, build, graphed_step, loss_of, prepare, stage_setup

    model, objective = stage_setup(build(teacher, model_name), model_name)
    optimizer, ids, cuda = prepare(model, batch, length, all_weights=model_name not in STAGES)
    if cuda_graph and not cuda:
        raise LinearizeError("--cuda-graph needs a CUDA device")
    device = ids.device
    loss_fn = loss_of(objective)
    graphed = graphed_step(model, objective) if cuda_graph else None

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def step():
        _step(model, optimizer, ids, cuda, graphed, loss_fn=loss_fn)

    for _ in range(warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):  # the wall time, without the profiler's own overhead
        step()
    sync()
    wall = (time.perf_counter() - t0) / steps * 1e6
    phases = host_phases(model, optimizer, ids, cuda, steps, sync, loss_fn=loss_fn, graphed=graphed)
    with profile(activities=activities(device)) as prof:
        for _ in range(steps):
            step()
        sync()
    out = kernel_table(prof, device, steps, top)
    if python_top:
        out["python"] = python_hotspots(step, steps, python_top, sync)
    busy, span = gpu_busy(prof) if cuda else (0.0, 0.0)
    out.update(what="train", model=model_name + ("+graph" if cuda_graph else ""), batch=batch, length=length,
               cuda_graph=cuda_graph, wall_us_per_step=wall, host_phases_us=phases,
               gpu_busy_us_per_step=busy / steps, profiled_span_us_per_step=span / steps,
               runtime=runtime_calls(prof, steps)[:top])
    return out


@torch.no_grad()
def profile_decode(model, batch: int = 1, tokens: int = 16, prompt_len: int = 32, compile: bool = False,
                   top: int = 20, fuse_projections: bool = True) -> dict:
    """Kernels per decode step: two profiled runs of different lengths, differenced, so the prefill cancels."""
    from torch.profiler import profile

    from ..decode import FastDecoder

    device = next(model.parameters()).device
    decoder = FastDecoder(model, cuda_graph=False, compile=compile, fuse_projections=fuse_projections)
    prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len),
                           generator=torch.Generator().manual_seed(0)).to(device)

    def run(n):
        decoder.generate(prompt, max_new_tokens=n, eos_token_id=None)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    run(tokens)  # warm-up (compilation)
    tables = []
    for n in (1, 1 + tokens):
        with profile(activities=activities(device)) as prof:
            run(n)
        tables.append({r["name"]: r for r in kernel_table(prof, device, 1, 10**9)["top"]})
    rows = []
    for name, r in tables[1].items():
        base = tables[0].get(name, {"us_per_step": 0.0, "launches_per_step": 0.0})
        us = (r["us_per_step"] - base["us_per_step"]) / tokens
        n = (r["launches_per_step"] - base["launches_per_step"]) / tokens
        if n > 0:
            rows.append({"name": name, "us_per_step": max(us, 0.0), "launches_per_step": n})
    rows.sort(key=lambda r: -r["us_per_step"])
    return {"what": "decode", "batch": batch, "prompt_len": prompt_len, "compile": compile,
            "unit": "kernel" if device.type == "cuda" else "operator", "steps": tokens,
            "us_per_step": sum(r["us_per_step"] for r in rows),
            "launches_per_step": sum(r["launches_per_step"] for r in rows), "top": rows[:top]}


@torch.no_grad()
def profile_prefill(model, batch: int = 1, prompt_len: int = 1024, steps: int = 2, top: int = 20,
                    backend: str | None = None, python_top: int = 0) -> dict:
    """Kernels (CUDA) or operators (CPU) of one prefill, per prefill and per decoder layer; with
    ``python_top``, also the Python functions that take the host's time (a short prefill is host-bound)."""
    import time

    from torch.profiler import profile

    from ..decode.fused import fused_projections
    from .prefill import prefill_once, student_backend

    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len),
                        generator=torch.Generator().manual_seed(0)).to(device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    with fused_projections(model), student_backend(model, backend):
        for _ in range(2):  # warm-up: Triton compiles, the allocator grows
            prefill_once(model, ids)
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            prefill_once(model, ids)
        sync()
        wall = (time.perf_counter() - t0) / steps * 1e6
        with profile(activities=activities(device)) as prof:
            for _ in range(steps):
                prefill_once(model, ids)
            sync()
        hotspots = python_hotspots(lambda: prefill_once(model, ids), steps, python_top, sync) if python_top else None
    out = kernel_table(prof, device, steps, top)
    if hotspots:
        out["python"] = hotspots
    layers = model.config.num_hidden_layers
    out.update(what="prefill", batch=batch, length=prompt_len, backend=backend or "spec", layers=layers,
               launches_per_layer=out["launches_per_step"] / layers, wall_us_per_step=wall,
               model="student" if getattr(model.config, "linearize", None) else "teacher")
    return out


def render(result: dict) -> str:
    head = (f"{result['what']}: {result.get('model', '')} "
            + (f"{result['batch']}x{result['length']}" if result["what"] in ("train", "prefill") else
               f"batch {result['batch']}{' compiled' if result.get('compile') else ''}")
            + f" — {result['us_per_step'] / 1000:.2f} ms of {result['unit']} time and "
              f"{result['launches_per_step']:.0f} {result['unit']} launches per step")
    lines = [head, *table_lines(result["unit"], result["top"])]
    if "launches_per_layer" in result:
        lines.append(f"{result['launches_per_layer']:.1f} {result['unit']} launches per decoder layer "
                     f"({result['layers']} layers; backend {result['backend']})")
    if "wall_us_per_step" in result:
        lines.append(f"wall time per step without the profiler: {result['wall_us_per_step'] / 1000:.2f} ms")
    if result.get("host_phases_us"):
        lines.append("host time per step (no sync between phases): " + ", ".join(
            f"{k} {v / 1000:.2f} ms" for k, v in result["host_phases_us"].items()))
    if result.get("profiled_span_us_per_step"):
        lines.append(f"GPU busy {result['gpu_busy_us_per_step'] / 1000:.2f} ms of a "
                     f"{result['profiled_span_us_per_step'] / 1000:.2f} ms profiled span per step")
    if result.get("runtime"):
        lines += ["| runtime call | host us/step | calls/step |", "|---|---|---|"]
        lines += [f"| {r['name'][:60]} | {r['us_per_step']:.1f} | {r['calls_per_step']:.1f} |" for r in result["runtime"]]
    if result.get("python"):
        lines += ["| Python function (cProfile) | own us/step | cumulative us/step | calls/step |", "|---|---|---|---|"]
        lines += [f"| {r['name'][-90:]} | {r['own_us_per_step']:.0f} | {r['cum_us_per_step']:.0f} | {r['calls_per_step']:.0f} |"
                  for r in result["python"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    import linearize

    from .train import MODELS, parse_shape

    p = argparse.ArgumentParser(prog="python -m linearize.bench.profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    tr = sub.add_parser("train", help="one training step of a model linearize.bench.train builds")
    tr.add_argument("--model", default="supra", choices=MODELS)
    tr.add_argument("--shape", default="16x1024", help="BATCHxLENGTH (default: %(default)s)")
    tr.add_argument("--teacher", default=None, help="a teacher as in 'linearize convert', e.g. shape:llama-3-8b "
                    "(random weights; default: the embedded SmolLM2)")
    tr.add_argument("--steps", type=int, default=2, help="profiled steps (default: %(default)s)")
    tr.add_argument("--python", type=int, default=0, metavar="N",
                    help="also list the N Python functions with the most host time (cProfile)")
    tr.add_argument("--cuda-graph", action="store_true",
                    help="replay the step's forward and backward as CUDA graphs, as bench.train --cuda-graph does")
    de = sub.add_parser("decode", help="the decode steps of a checkpoint on the fast path")
    de.add_argument("model", help="a linearize checkpoint (or a teacher spec)")
    de.add_argument("--batch", type=int, default=1)
    de.add_argument("--tokens", type=int, default=16, help="decode steps profiled (default: %(default)s)")
    de.add_argument("--prompt-len", type=int, default=32,
                    help="the prompt before them: a softmax teacher's steps read its whole cache (default: %(default)s)")
    de.add_argument("--compile", action="store_true", help="compile the decode step")
    de.add_argument("--unfused", action="store_true", help="keep q/k/v and gate/up as separate products")
    de.add_argument("--dtype", default="bfloat16")
    pf = sub.add_parser("prefill", help="one prompt's prefill of a checkpoint or a teacher")
    pf.add_argument("model", help="a linearize checkpoint (or a teacher spec)")
    pf.add_argument("--batch", type=int, default=1)
    pf.add_argument("--prompt-len", type=int, default=1024, help="(default: %(default)s)")
    pf.add_argument("--steps", type=int, default=2, help="profiled prefills (default: %(default)s)")
    pf.add_argument("--backend", choices=["auto", "torch", "fla"], default=None,
                    help="the converted layers' backend (default: the checkpoint's spec)")
    pf.add_argument("--dtype", default="bfloat16")
    pf.add_argument("--python", type=int, default=0, metavar="N",
                    help="also list the N Python functions with the most host time (cProfile)")
    for s in (tr, de, pf):
        s.add_argument("--top", type=int, default=20, help="rows to print (default: %(default)s)")
        s.add_argument("--device", default=None, help="default: cuda when available")
        s.add_argument("--out", default=None, help="write the result as JSON here")
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        if args.what == "train":
            b, t = parse_shape(args.shape)
            teacher, _ = linearize.load_teacher(args.teacher, dtype="float32", device=device)
            result = profile_train(teacher, args.model, b, t, steps=args.steps, top=args.top, python_top=args.python,
                                   cuda_graph=args.cuda_graph)
        else:
            model, _ = linearize.load_model(args.model, dtype=args.dtype, device=device)
            if args.what == "prefill":
                result = profile_prefill(model, args.batch, args.prompt_len, steps=args.steps, top=args.top,
                                         backend=args.backend, python_top=args.python)
            else:
                result = profile_decode(model, args.batch, args.tokens, prompt_len=args.prompt_len, compile=args.compile,
                                        top=args.top, fuse_projections=not args.unfused)
    except LinearizeError as e:
        p.exit(2, f"linearize: error: {e}\n")
    print(render(result))
    if args.out:
        from pathlib import Path

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
