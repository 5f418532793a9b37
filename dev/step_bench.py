"""Time the LoLCATs hybrid's fused decode step (``ops/hybrid/step_triton.py``) alone on CUDA, as the
fast decoder runs it: one CUDA graph of ``--layers`` steps, each on its own layer's state (so a large
batch's states do not sit in L2 between steps as they would not in the model), for each batch and
each setting of the step's constants (warps, value parts).

    python dev/step_bench.py [--batches 1 64 256] [--warps 0 2 4 8] [--splits 0 1 2 4]
                             [--shape smollm2-135m|llama-3.2-1b|llama-3-8b]
                             [--layout default|plain] [--module FILE ...] [--out FILE]

Heads and head dim are the ``--shape``'s (default SmolLM2-135M's: 9 query heads, 3 key heads, head
dim 64; Llama-3.2-1B 32 / 8 / 64; Llama-3-8B and 70B 32 / 8 / 128 and 64 / 8 / 128), Hedgehog
features 2 x 64, window 64. ``--layout default``: the default student's step (a gated linear state whose gate comes from
the projection's output, the features of q and k before RoPE); ``plain``: plain LoLCATs'.
``--warps 0`` and ``--splits 0`` are the module's defaults. ``--module`` adds another
version of the module (e.g. one from an earlier commit, ``git show REV:src/linearize/ops/hybrid/step_triton.py``)
to time beside the installed one. Each setting's output for one step from the same state is compared with
the first setting's (largest absolute difference). Prints µs per step and effective GB/s of the state's
bytes (window read, with its key features in the default layout; linear state read and written).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_bench import HEADS, graph_us  # noqa: E402

H, HK, D, FH, W = 9, 3, 64, 64, 64
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def load(path):
    if path is None:
        from linearize.ops.hybrid import step_triton

        return "current", step_triton
    spec = importlib.util.spec_from_file_location(f"step_{abs(hash(path))}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return path, mod


def states(b, splits, layers, gen, gated=False):
    from linearize.ops import FusedRingState

    out = []
    for _ in range(layers):
        r = lambda *s: torch.randn(*s, device=DEV, generator=gen)  # noqa: E731
        linear = r(b, HK, 2, 2 * FH, D + 1).abs() * 0.1  # the normaliser column must stay positive
        feats = (r(b, HK, W, 2 * FH).abs() * 0.1).bfloat16() if gated else torch.empty(b, HK, 0, 2 * FH, device=DEV)
        gates = dict(evict_features=r(b, HK, 2, 2 * FH).abs() * 0.1, evict_values=r(b, HK, 2, D)) if gated else {}
        out.append(FusedRingState(r(b, HK, W, D).bfloat16(), feats,
                                  r(b, HK, W, D).bfloat16(), linear, torch.ones(b, W, dtype=torch.bool, device=DEV),
                                  slot=torch.zeros((), dtype=torch.long, device=DEV),
                                  ticks=torch.zeros(b, H, splits, dtype=torch.int32, device=DEV), **gates))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 64, 256])
    p.add_argument("--warps", nargs="+", type=int, default=[0, 2, 4, 8])
    p.add_argument("--splits", nargs="+", type=int, default=[0, 1, 2, 4])
    p.add_argument("--chunks", nargs="+", type=int, default=[0],
                   help="value columns a program takes at a time (STEP_CHUNK, modules that have it; 0: its default)")
    p.add_argument("--layout", choices=("default", "plain"), default="default")
    p.add_argument("--shape", choices=sorted(HEADS), default="smollm2-135m", help="query heads, key heads, head dim")
    p.add_argument("--module", nargs="*", default=[])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--out")
    args = p.parse_args(argv)
    global H, HK, D
    H, HK, D = HEADS[args.shape]
    if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("step_bench.py needs CUDA (or TRITON_INTERPRET=1 for a dry run on the CPU)")
    gen = torch.Generator(device=DEV).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=DEV, generator=gen)  # noqa: E731
    wq, wk, logit = (r(H, D, FH) * 0.2).bfloat16(), (r(HK, D, FH) * 0.2).bfloat16(), r(H).bfloat16()
    modules = [load(None), *(load(path) for path in args.module)]
    gated = args.layout == "default"
    rows = []
    print("| module | batch | warps | splits | chunk | µs/step | GB/s | max err |\n|---|---|---|---|---|---|---|---|")
    for b in args.batches:
        qkv = r(b, 1, H + 2 * HK + 1, D).bfloat16()  # the last head's first column stands for the gate's input
        q, k, v = (x.transpose(1, 2) for x in qkv[:, :, : H + 2 * HK].split([H, HK, HK], dim=2))
        extra = dict(gate_input=qkv[:, :, H + 2 * HK, :HK], gate_bias=r(HK).bfloat16(),
                     feature_rope=False) if gated else {}
        ang = 2000.0 * 10000.0 ** (-torch.arange(D // 2, device=DEV) / (D // 2))
        emb = torch.cat([ang, ang], -1)[None, None]
        pe = (emb.cos().bfloat16(), emb.sin().bfloat16())
        # window (and its key features) read, linear state read + written
        state_bytes = b * HK * (2 * W * D * 2 + (W * 2 * FH * 2 if gated else 0) + 2 * 2 * FH * (D + 1) * 4)
        want = None
        for (name, mod), warps, splits, chunk in itertools.product(modules, args.warps, args.splits, args.chunks):
            if chunk and not hasattr(mod, "STEP_CHUNK"):
                continue
            default_chunk = getattr(mod, "STEP_CHUNK", None)
            parts = splits or mod.value_splits(b, H, D)
            mod.STEP_WARPS = warps or None
            if chunk:
                mod.STEP_CHUNK = chunk
            ref = states(b, parts, 1, torch.Generator(device=DEV).manual_seed(1), gated)[0]  # the same for each
            y = mod.hybrid_step_fused_triton(q, k, v, pe, wq, wk, logit, ref, scale=D ** -0.5, **extra).float()
            want = y if want is None else want
            err = (y - want).abs().max().item()
            layers = states(b, parts, args.layers, gen, gated)
            step = lambda: [mod.hybrid_step_fused_triton(q, k, v, pe, wq, wk, logit, s, scale=D ** -0.5,  # noqa: E731
                                                         **extra) for s in layers]
            us = graph_us(step, args.replays) / args.layers
            mod.STEP_WARPS = None
            if default_chunk is not None:
                mod.STEP_CHUNK = default_chunk
            row = dict(module=name, layout=args.layout, shape=args.shape, batch=b, warps=warps or "default",
                       splits=parts, chunk=chunk or default_chunk, us_per_step=us, gb_per_s=state_bytes / us / 1e3, max_err=err)
            rows.append(row)
            print(f"| {name} | {b} | {row['warps']} | {parts} | {row['chunk']} | {us:.1f} | "
                  f"{row['gb_per_s']:.0f} | {err:.3g} |", flush=True)
            del layers
    if args.out:
        json.dump(rows, open(args.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
