"""Time the window softmax's whole-sequence forms without a gradient on CUDA, as a prefill runs them: the one-launch
Triton kernel (``ops/window/parallel_triton.py``) for each setting of its module constants, the causal flash
calls on blocks (``flash.py``) and SDPA on masked blocks, each with the teacher's causal SDPA over the same tokens
beside them (what a kept layer's attention costs without a window).

    python dev/window_prefill_bench.py [--shapes 1x32768 32x1024] [--windows 1280 4160] [--bm 64 128]
                                       [--bn 32 64 128] [--warps 4 8] [--stages 2 3 4] [--out FILE]

Shapes are a kept layer's of the SmolLM2-135M student (9 query heads on 3 key heads, head dim 64, bf16), q/k/v
as strided slices of one projection's output, as the adapters give them. ``0`` in a sweep means the module's
default. Each setting's output is compared with SDPA on blocks (largest absolute difference). Prints ms per
call (median of CUDA-event timings) and TFLOP/s of the useful products (4 x D per query and key it weighs, per head).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_bench import timed  # noqa: E402

H, HK, D = 9, 3, 64


def main(argv=None) -> int:
    from linearize.ops import window
    from linearize.ops.window import flash, parallel_triton
    from linearize.ops.window.sinks import sink_index, window_softmax_sinks_sdpa

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["1x32768", "32x1024"], help="batch x tokens")
    p.add_argument("--windows", nargs="+", type=int, default=[1280, 4160])
    p.add_argument("--bm", nargs="+", type=int, default=[0])
    p.add_argument("--bn", nargs="+", type=int, default=[0])
    p.add_argument("--warps", nargs="+", type=int, default=[0])
    p.add_argument("--stages", nargs="+", type=int, default=[0])
    p.add_argument("--sinks", nargs="+", type=int, default=[0], help="attention sinks (ops/window/sinks.py) for the "
                   "kernel's rows, each against the blocked sinks form")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 1
    default = (parallel_triton.PARALLEL_BM, parallel_triton.PARALLEL_BN, parallel_triton.PARALLEL_WARPS,
               parallel_triton.PARALLEL_STAGES)
    rows = []
    print("| form | shape | window | BM | BN | warps | stages | ms | TFLOP/s | max diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    torch.set_grad_enabled(False)
    for shape, w in itertools.product(args.shapes, args.windows):
        b, t = (int(x) for x in shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        out = torch.randn(b, t, (H + 2 * HK) * D, device="cuda", generator=g).bfloat16()
        q, k, v = (x.unflatten(-1, (-1, D)).transpose(1, 2) for x in out.split([H * D, HK * D, HK * D], -1))
        ref = window.window_softmax_sdpa(q, k, v, window=w, scale=D ** -0.5)
        flops = 4 * b * H * D * sum(min(i + 1, w) for i in range(t))

        def emit(form, cfg, ms, got, work=flops):
            diff = (got.float() - ref.float()).abs().max().item() if got is not None else None
            rec = dict(form=form, shape=shape, window=w, bm=cfg[0], bn=cfg[1], warps=cfg[2], stages=cfg[3], ms=ms,
                       tflops=work / ms / 1e9, max_diff=diff)
            rows.append(rec)
            cells = ["-" if x is None else x for x in cfg]
            print(f"| {form} | {shape} | {w} | {cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} | {ms:.3f} | "
                  f"{rec['tflops']:.0f} | {'-' if diff is None else f'{diff:.3g}'} |", flush=True)

        for bm, bn, warps, stages, n_sinks in itertools.product(args.bm, args.bn, args.warps, args.stages, args.sinks):
            cfg = (bm or default[0], bn or default[1], warps or default[2], stages or default[3])
            (parallel_triton.PARALLEL_BM, parallel_triton.PARALLEL_BN, parallel_triton.PARALLEL_WARPS,
             parallel_triton.PARALLEL_STAGES) = cfg
            try:
                pos = sink_index(None, b, t, n_sinks, q.device) if n_sinks else None
                fn = lambda: parallel_triton.window_softmax_triton(q, k, v, window=w, scale=D ** -0.5,  # noqa: E731
                                                                   sink_positions=pos)
                if n_sinks:
                    want = window_softmax_sinks_sdpa(q, k, v, window=w, sinks=n_sinks, scale=D ** -0.5)
                    got = fn()
                    got = ref + (got.float() - want.float())  # the max diff column: against the sinks form
                    emit(f"triton + {n_sinks} sinks", cfg, timed(fn, args.runs), got)
                else:
                    emit("triton", cfg, timed(fn, args.runs), fn())
            except Exception as e:  # a tile that does not fit (shared memory): say so, go on
                print(f"| triton | {shape} | {w} | {cfg} | failed: {str(e).splitlines()[0][:80]} |")
        (parallel_triton.PARALLEL_BM, parallel_triton.PARALLEL_BN, parallel_triton.PARALLEL_WARPS,
         parallel_triton.PARALLEL_STAGES) = default
        none = (None,) * 4
        if flash.supported(q, k, v, w):
            fn = lambda: flash.window_softmax_flash(q, k, v, window=w, scale=D ** -0.5)  # noqa: E731
            emit("flash blocks", none, timed(fn, args.runs), fn())
        fn = lambda: window.window_softmax_sdpa(q, k, v, window=w, scale=D ** -0.5)  # noqa: E731
        emit("sdpa blocks", none, timed(fn, args.runs), ref)
        qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
        fn = lambda: F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=True)  # noqa: E731
        emit("causal sdpa (no window)", none, timed(fn, args.runs), None, work=4 * b * H * D * t * (t + 1) // 2)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
