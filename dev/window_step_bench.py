"""Time the window softmax's ring step (``ops/window/step_triton.py``) alone on CUDA, as the fast decoder runs
it: one CUDA graph of ``--layers`` steps, each on its own layer's ring (so that a large batch's rings do not
sit in L2 between steps), for each batch and each setting of the kernel's module constants, beside the
PyTorch step (``window_softmax_step_ring`` with ``WINDOW_STEP_KERNEL`` off).

    python dev/window_step_bench.py [--batches 1 8 64 256] [--blocks 32 64 128] [--warps 2 4 8]
                                    [--programs 0 1 528] [--stages 0 2 3 4] [--fma] [--float8] [--hold]
                                    [--min-parts 0 2 3] [--max-parts 0 16] [--merge-parts 0 1 16] [--layers 14]
                                    [--out FILE]
                                    [--shape smollm2-135m|llama-3.2-1b|llama-3-8b|llama-3-70b]

Heads are the ``--shape``'s (default a kept layer's of the SmolLM2-135M student: 9 query heads, 3 key heads,
head dim 64), a ring of ``--window`` 1,280 slots, bf16. ``0`` means the module's default (``--programs 1``: never split the ring);
``--fma`` adds the products as broadcast sums (``STEP_MMA = False``); ``--float8`` times float8 rings
(``float8_window_step_ring``: the kernel quantising the new token itself, or its PyTorch path); ``--hold`` times
each tensor-core setting of a float8 ring also with its values held converted where loaded (``STEP_HOLD_VALUES``:
rows ``held``). ``--min-parts``: the fewest parts a ring is read in (``STEP_MIN_PARTS``: a crowded batch's rings
in parts too); ``--max-parts``: the most (``STEP_MAX_PARTS``: a long ring's merge at batch 1); ``--merge-parts``: the
parts the last one merges a tile at a time (``MERGE_PARTS``; 1: one by one, as before 3a5844e). Each setting's
output for one step
from the same ring is compared with the PyTorch step's (largest absolute difference). Prints µs per layer
step and the effective GB/s of the ring's bytes (keys and values read once).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_bench import HEADS, graph_us  # noqa: E402

H, HK, D = 9, 3, 64
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rings(b, w, layers, gen, float8=False, filled=None):
    from linearize.ops import RingHybridState
    from linearize.ops.window import float8 as f8

    out = []
    for _ in range(layers):
        keys, values = (torch.randn(b, HK, w, D, device=DEV, generator=gen).bfloat16() for _ in range(2))
        valid = torch.ones(b, w, dtype=torch.bool, device=DEV)
        if filled is not None:  # as after a prompt of `filled` tokens: the slots past them empty
            valid[:, filled:] = False
        common = (torch.zeros(b, HK, 1, 1, D + 1, device=DEV), valid)
        slot = torch.full((), min(filled or 0, w - 1), dtype=torch.long, device=DEV)
        if float8:  # e4m3 codes with a float32 scale per slot and key head
            (k8, ks), (v8, vs) = f8.quantize(keys), f8.quantize(values)
            out.append(f8.Float8RingState(k8.contiguous(), keys[..., :0], v8.contiguous(), *common, slot=slot,
                                          key_scale=ks.contiguous(), value_scale=vs.contiguous()))
        else:
            out.append(RingHybridState(keys, keys[..., :0], values, *common, slot=slot))
    return out


def main(argv=None) -> int:
    from linearize.ops import window
    from linearize.ops.window import step_triton

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64, 256])
    p.add_argument("--window", type=int, default=1280)
    p.add_argument("--filled", type=int, default=None, help="slots holding tokens (default: all)")
    p.add_argument("--skip", nargs="+", type=int, default=[1],
                   help="1: empty blocks are not read (STEP_SKIP_EMPTY), 0: every block is")
    p.add_argument("--shape", choices=sorted(HEADS), default="smollm2-135m", help="query heads, key heads, head dim")
    p.add_argument("--blocks", nargs="+", type=int, default=[0])
    p.add_argument("--warps", nargs="+", type=int, default=[0])
    p.add_argument("--programs", nargs="+", type=int, default=[0])
    p.add_argument("--stages", nargs="+", type=int, default=[0])
    p.add_argument("--min-parts", nargs="+", type=int, default=[0])
    p.add_argument("--max-parts", nargs="+", type=int, default=[0])
    p.add_argument("--merge-parts", nargs="+", type=int, default=[0])
    p.add_argument("--fma", action="store_true")
    p.add_argument("--float8", action="store_true", help="float8 rings (the kernel quantising the new token itself)")
    p.add_argument("--hold", action="store_true", help="float8 rings on the tensor cores with their values held "
                   "converted where loaded too (STEP_HOLD_VALUES)")
    p.add_argument("--layers", type=int, default=14)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--out")
    args = p.parse_args(argv)
    global H, HK, D
    H, HK, D = HEADS[args.shape]
    if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("window_step_bench.py needs CUDA (or TRITON_INTERPRET=1 for a dry run on the CPU)")
    defaults = {k: getattr(step_triton, k) for k in ("STEP_BLOCK", "STEP_WARPS", "STEP_PROGRAMS", "STEP_STAGES",
                                                      "STEP_MMA", "STEP_CROWDED_FP8", "STEP_HOLD_VALUES",
                                                      "STEP_MIN_PARTS", "STEP_MAX_PARTS", "MERGE_PARTS", "STEP_SKIP_EMPTY")}
    from linearize.ops.window import float8 as f8

    gen = torch.Generator(device=DEV).manual_seed(0)
    kw = dict(scale=D ** -0.5, softcap=None)
    if args.float8:  # the float8 ring's step: the kernel, or (``torch``) its PyTorch path on the read-back ring
        def ring_step(q, k, v, state, **kw):
            f8.FLOAT8_STEP_KERNEL = window.WINDOW_STEP_KERNEL
            return f8.float8_window_step_ring(q, k, v, state, window.window_softmax_step_ring, **kw)
    else:
        ring_step = window.window_softmax_step_ring
    rows = []
    print("| step | batch | block | warps | programs | stages | min parts | max parts | merge | skip empty | µs/layer | GB/s | "
          "max err |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for b in args.batches:
        q = torch.randn(b, H, 1, D, device=DEV, generator=gen).bfloat16()
        k, v = (torch.randn(b, HK, 1, D, device=DEV, generator=gen).bfloat16() for _ in range(2))
        ring_bytes = b * HK * args.window * ((D + 4) if args.float8 else D * 2) * 2
        want = None
        settings = [("torch", {})]
        holds = [False, True] if args.hold and args.float8 else [defaults["STEP_HOLD_VALUES"]]
        for mma, block, warps, programs, stages, hold, least, most, merge, skip in itertools.product(
                [True, False] if args.fma else [True], args.blocks, args.warps, args.programs, args.stages, holds,
                args.min_parts, args.max_parts, args.merge_parts, args.skip):
            if hold and not mma:
                continue  # broadcast sums read the values as they are
            name = ("held" if hold else "kernel") if mma else "fma"
            settings.append((name, dict(
                STEP_MMA=mma, STEP_BLOCK=block or defaults["STEP_BLOCK"], STEP_WARPS=warps or defaults["STEP_WARPS"],
                STEP_PROGRAMS=programs or defaults["STEP_PROGRAMS"], STEP_STAGES=stages or defaults["STEP_STAGES"],
                STEP_HOLD_VALUES=hold, STEP_MIN_PARTS=least or defaults["STEP_MIN_PARTS"],
                STEP_MAX_PARTS=most or defaults["STEP_MAX_PARTS"], MERGE_PARTS=merge or defaults["MERGE_PARTS"], STEP_SKIP_EMPTY=bool(skip),
                # tiles given (a block, warps, broadcast sums): those, crowded or not; none: the module's choice
                # (its crowded tiles too)
                STEP_CROWDED_FP8=None if block or warps or not mma else defaults["STEP_CROWDED_FP8"])))
        for name, consts in settings:
            for key, value in {**defaults, **consts}.items():
                setattr(step_triton, key, value)
            window.WINDOW_STEP_KERNEL = name != "torch"
            seed = torch.Generator(device=DEV).manual_seed(1)
            one = rings(b, args.window, 1, seed, args.float8, args.filled)[0]  # the same ring for each setting
            y = ring_step(q, k, v, one, **kw)[0].float()
            want = y if want is None else want
            err = (y - want).abs().max().item()
            layers = rings(b, args.window, args.layers, gen, args.float8, args.filled)
            step = lambda: [ring_step(q, k, v, s, **kw) for s in layers]  # noqa: E731
            us = graph_us(step, args.replays) / args.layers
            shown = {k.removeprefix("STEP_").lower(): consts.get(k, "-") for k in
                     ("STEP_BLOCK", "STEP_WARPS", "STEP_PROGRAMS", "STEP_STAGES", "STEP_MIN_PARTS", "STEP_MAX_PARTS", "MERGE_PARTS", "STEP_SKIP_EMPTY")}
            if name != "torch":  # the tiles the step took (a crowded float8 ring's own, where they apply)
                aimed = (step_triton._target_programs(q.device) if q.is_cuda or step_triton.STEP_PROGRAMS is not None
                         else 1 << 30)
                mma, shown["block"], shown["warps"] = step_triton.step_tiles(b, HK, D, args.float8, aimed)
                name = ("held" if args.float8 and step_triton.STEP_HOLD_VALUES else "kernel") if mma else "fma"
            row = dict(step=name, shape=args.shape, batch=b, **shown, us_per_layer=us, gb_per_s=ring_bytes / us / 1e3, max_err=err)
            rows.append(row)
            print(f"| {name} | {b} | {shown['block']} | {shown['warps']} | {shown['programs']} | {shown['stages']} | "
                  f"{shown['min_parts']} | {shown['max_parts']} | {shown['merge_parts']} | {shown['skip_empty']} | {us:.1f} | {row['gb_per_s']:.0f} | {err:.3g} |",
                  flush=True)
            del layers
        for key, value in defaults.items():
            setattr(step_triton, key, value)
        window.WINDOW_STEP_KERNEL = f8.FLOAT8_STEP_KERNEL = True
    if args.out:
        json.dump(rows, open(args.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
