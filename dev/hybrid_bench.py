"""The LoLCATs hybrid's whole-sequence kernels alone, at SmolLM2's attention shape (9 query heads on 3
key heads, head dim 64, Hedgehog features 2 x 64, window 64, bf16), on CUDA: milliseconds of the
forward and of forward + backward (median of ``triton.testing.do_bench``, compilation warmed up) for

* ``kernels (fused)``: RoPE and Hedgehog maps inside the forward kernels, from the projections' q/k/v
  (what the LoLCATs mixer runs);
* ``kernels (fused), PyTorch prelude``: the same forward; the backward recomputes RoPE and the maps
  in PyTorch (``chunk_triton.FUSED_PRELUDE = False``) instead of the prelude's Triton kernels;
* ``kernels (features given)``: RoPE and the maps in PyTorch, the hybrid in the kernels (what pays:
  fusing the maps or not);
* ``torch chunked``: RoPE, the maps and ``hybrid_attention_chunked`` in PyTorch (before the kernels);
* ``teacher sdpa``: RoPE and causal softmax attention through SDPA with grouped keys (the teacher's).

    python dev/hybrid_bench.py [--shapes 1x1024 1x8192 32x1024 1x32768] [--sweep] [--sweep-prefill] [--kernels]
                               [--out F]

``--sweep`` also times the fused forward and backward with each constant of ``KNOBS`` (warps, query /
key rows of the hybrid's kernels and the RoPE + Hedgehog prelude's) varied alone, then with each
one's fastest value together; ``--sweep-prefill`` the forward without gradients (a prefill's output
pass) for every pair of ``PREFILL_KNOBS``; ``--kernels`` lists each kernel's device time in a forward
+ backward.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_bench import kernel_ms  # noqa: E402

H, HK, D, FH, W = 9, 3, 64, 64, 64


def _split(qkv):
    """q/k/v as the adapters give them: [B, heads, T, D] views of one projection's output."""
    return tuple(x.transpose(1, 2) for x in qkv.split([H, HK, HK], dim=2))


def _inputs(b, t, g):
    qkv = torch.randn(b, t, H + 2 * HK, D, device="cuda", generator=g, dtype=torch.bfloat16)
    angles = torch.randn(1, t, D // 2, device="cuda", generator=g)
    cos, sin = torch.cat([angles, angles], -1).cos().bfloat16(), torch.cat([angles, angles], -1).sin().bfloat16()
    wq = (torch.randn(H, D, FH, device="cuda", generator=g) * 0.1).requires_grad_()
    wk = (torch.randn(HK, D, FH, device="cuda", generator=g) * 0.1).requires_grad_()
    logit = torch.zeros(H, device="cuda", requires_grad=True)
    return qkv, (cos, sin), wq, wk, logit


def paths(b, t, g):
    from linearize import ops
    from linearize.ops.hybrid import chunk_triton as chunk_triton_module
    from linearize.ops.hybrid.chunk_triton import hedgehog_features, hybrid_triton, rope_half

    qkv, rope, wq, wk, logit = _inputs(b, t, g)
    kw = dict(window=W, scale=D ** -0.5)

    def fused(prelude=True):
        chunk_triton_module.FUSED_PRELUDE = prelude  # read by the backward, which runs before the next path
        q, k, v = _split(qkv)
        return hybrid_triton(q, k, v, logit, hedgehog=(wq, wk), rope=rope, **kw, logit=True)[0]

    def given():
        q, k, v = _split(qkv)
        qr, kr = rope_half(q, *rope), rope_half(k, *rope)
        return hybrid_triton(qr, kr, v, torch.sigmoid(logit), qf=hedgehog_features(qr, wq), kf=hedgehog_features(kr, wk),
                             **kw)[0]

    def chunked():
        q, k, v = _split(qkv)
        qr, kr = rope_half(q, *rope), rope_half(k, *rope)
        return ops.hybrid_attention_chunked(qr, kr, hedgehog_features(qr, wq), hedgehog_features(kr, wk), v,
                                            torch.sigmoid(logit), **kw)[0]

    def teacher():
        q, k, v = _split(qkv)
        qr, kr = rope_half(q, *rope), rope_half(k, *rope)
        return torch.nn.functional.scaled_dot_product_attention(qr, kr, v, is_causal=True, enable_gqa=True)

    grads = [qkv, wq, wk, logit]
    return {"kernels (fused)": fused, "kernels (fused), PyTorch prelude": lambda: fused(False),
            "kernels (features given)": given, "torch chunked": chunked,
            "teacher sdpa": teacher}, qkv, grads


def time_path(fn, qkv, grads, backward: bool):
    import triton

    if not backward:
        with torch.no_grad():
            return triton.testing.do_bench(fn, warmup=25, rep=100)
    qkv.requires_grad_(True)
    dy = None

    def step():
        nonlocal dy
        y = fn()
        if dy is None:
            dy = torch.randn_like(y)
        torch.autograd.grad(y, [x for x in grads if x.requires_grad], dy, allow_unused=True)

    out = triton.testing.do_bench(step, warmup=25, rep=100)
    qkv.requires_grad_(False)
    return out


# the kernels' constants the sweep varies, one at a time around the defaults: (module, name, values)
KNOBS = [("hybrid.chunk_triton", "SUM_WARPS", (2, 4, 8)), ("hybrid.chunk_triton", "FWD_WARPS", (2, 4, 8)),
         ("hybrid.chunk_triton", "BWD_WARPS", (2, 4, 8)), ("hybrid.chunk_triton", "KEY_WARPS", (2, 4, 8)),
         ("hybrid.chunk_triton", "QUERY_ROWS", (16, 32, 64)), ("hybrid.chunk_triton", "BWD_QUERY_ROWS", (16, 32, 64)),
         ("hybrid.chunk_triton", "KEY_ROWS", (16, 32, 64)),
         ("hybrid.prelude_triton", "FWD_ROWS", (64, 128, 256)), ("hybrid.prelude_triton", "FWD_WARPS", (2, 4, 8)),
         ("hybrid.prelude_triton", "BWD_ROWS", (32, 64, 128)), ("hybrid.prelude_triton", "BWD_WARPS", (2, 4, 8)),
         ("hybrid.prelude_triton", "PRELUDE_PROGRAMS", (1024, 2048, 4096))]


def kernels_ms(fn, qkv, grads, runs: int = 20, total: bool = True):
    """Device time of the kernels of one forward + backward of ``fn``, in ms: their sum (what a
    CUDA-graphed training step pays, without the host's launch time that blurs ``do_bench`` here),
    or with ``total`` False each kernel's (``{name: ms}``, largest first)."""
    qkv.requires_grad_(True)

    def step():
        y = fn()
        torch.autograd.grad(y, [x for x in grads if x.requires_grad], torch.ones_like(y), allow_unused=True)

    try:
        per = kernel_ms(step, runs)
        return sum(per.values()) if total else per
    finally:
        qkv.requires_grad_(False)


def sweep(shapes, g, rows) -> dict:
    """The fused path's kernel time (``kernels_ms``, summed over ``shapes``) with each of ``KNOBS``
    varied alone (the others at their defaults), then with every knob at its fastest value; rows go
    to ``rows``. Returns that combination (``{"module.NAME": value}``); the defaults are restored."""
    import importlib

    mods = {m: importlib.import_module(f"linearize.ops.{m}") for m, _, _ in KNOBS}
    defaults = {(m, n): getattr(mods[m], n) for m, n, _ in KNOBS}
    inputs = {shape: paths(*(int(x) for x in shape.split("x")), g) for shape in shapes}

    def timed(setting: dict) -> float:
        for (m, n), value in {**defaults, **setting}.items():
            setattr(mods[m], n, value)
        total = 0.0
        for shape, (fns, qkv, grads) in inputs.items():
            b, t = (int(x) for x in shape.split("x"))
            try:
                ms = kernels_ms(fns["kernels (fused)"], qkv, grads)
            except Exception as err:  # a setting the compiler refuses (e.g. out of shared memory)
                print(f"sweep {b}x{t} {setting}: failed ({type(err).__name__}: {str(err)[:80]})", flush=True)
                return float("inf")
            rows.append({"path": "sweep", "batch": b, "length": t, "knobs": {f"{m}.{n}": v for (m, n), v in setting.items()},
                         "kernel_ms": ms})
            print(f"sweep {b}x{t} {setting or 'defaults'}: kernels of forward + backward {ms:.4f} ms", flush=True)
            total += ms
        return total

    try:
        base = timed({})
        choice = {}
        for m, n, values in KNOBS:
            scores = {v: (base if v == defaults[(m, n)] else timed({(m, n): v})) for v in values}
            fastest = min(scores, key=scores.get)
            if fastest != defaults[(m, n)] and scores[fastest] < 0.99 * base:
                choice[(m, n)] = fastest
        together = timed(choice) if choice else base
        print(f"defaults {base:.3f} ms; each knob's fastest together {together:.3f} ms: "
              f"{ {f'{m}.{n}': v for (m, n), v in choice.items()} }", flush=True)
        return {"defaults_ms": base, "together_ms": together, "knobs": {f"{m}.{n}": v for (m, n), v in choice.items()}}
    finally:
        for (m, n), value in defaults.items():
            setattr(mods[m], n, value)


# the output pass without a backward (a prefill's): its own tiles, swept together
PREFILL_KNOBS = (("PREFILL_QUERY_ROWS", (16, 32, 64)), ("PREFILL_WARPS", (2, 4, 8)))


def sweep_prefill(shapes, g, rows) -> dict:
    """The fused path's forward without gradients (what a prefill runs): its kernels' device time,
    summed over ``shapes``, for every pair of ``PREFILL_KNOBS`` values; rows go to ``rows``. Returns the
    fastest pair (``{"hybrid.chunk_triton.NAME": value}``) and its time against the defaults'; the defaults
    are restored."""
    import itertools

    from linearize.ops.hybrid import chunk_triton as kernels

    names = [n for n, _ in PREFILL_KNOBS]
    defaults = {n: getattr(kernels, n) for n in names}
    inputs = {shape: paths(*(int(x) for x in shape.split("x")), g)[0]["kernels (fused)"] for shape in shapes}
    times = {}
    try:
        for values in itertools.product(*(v for _, v in PREFILL_KNOBS)):
            setting = dict(zip(names, values))
            for n, v in setting.items():
                setattr(kernels, n, v)
            total = 0.0
            for shape, fn in inputs.items():
                b, t = (int(x) for x in shape.split("x"))

                def step():
                    with torch.no_grad():
                        fn()

                try:
                    ms = sum(kernel_ms(step, 20).values())
                except Exception as err:  # a setting the compiler refuses
                    print(f"prefill sweep {b}x{t} {setting}: failed ({type(err).__name__}: {str(err)[:80]})", flush=True)
                    total = float("inf")
                    break
                rows.append({"path": "prefill sweep", "batch": b, "length": t,
                             "knobs": {f"hybrid.chunk_triton.{n}": v for n, v in setting.items()}, "kernel_ms": ms})
                print(f"prefill sweep {b}x{t} {setting}: forward kernels {ms:.4f} ms", flush=True)
                total += ms
            times[values] = total
    finally:
        for n, v in defaults.items():
            setattr(kernels, n, v)
    best = min(times, key=times.get)
    base = times[tuple(defaults[n] for n in names)]
    print(f"prefill: defaults {base:.3f} ms, fastest {dict(zip(names, best))} {times[best]:.3f} ms", flush=True)
    return {"defaults_ms": base, "fastest_ms": times[best],
            "knobs": {f"hybrid.chunk_triton.{n}": v for n, v in zip(names, best) if v != defaults[n]}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["1x1024", "1x8192", "32x1024", "1x32768"])
    p.add_argument("--skip", nargs="*", default=[], help="paths to leave out (e.g. 'torch chunked' at long lengths)")
    p.add_argument("--sweep", action="store_true", help="time the fused kernels with each knob of KNOBS varied alone, "
                                                          "then with each knob's fastest value together")
    p.add_argument("--kernels", action="store_true", help="each kernel's device time in a fused forward + backward")
    p.add_argument("--sweep-prefill", action="store_true", help="time the fused forward without gradients (a "
                                                                  "prefill's kernels) for every pair of PREFILL_KNOBS")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print("| path | batch x length | forward ms | forward+backward ms | tokens/s (fwd) |")
    print("|---|---|---|---|---|")
    for shape in args.shapes:
        b, t = (int(x) for x in shape.split("x"))
        fns, qkv, grads = paths(b, t, g)
        for name, fn in fns.items():
            if name in args.skip:
                continue
            try:
                fwd = time_path(fn, qkv, grads, backward=False)
                both = time_path(fn, qkv, grads, backward=True)
            except torch.OutOfMemoryError:
                fwd = both = None
                torch.cuda.empty_cache()
            rows.append({"path": name, "batch": b, "length": t, "forward_ms": fwd, "forward_backward_ms": both})
            fmt = lambda x: "OOM" if x is None else f"{x:.3f}"  # noqa: E731
            tok = "—" if fwd is None else f"{b * t / fwd * 1000:,.0f}"
            print(f"| {name} | {b}x{t} | {fmt(fwd)} | {fmt(both)} | {tok} |", flush=True)
        del fns, qkv, grads
        torch.cuda.empty_cache()
    best_knobs = best_prefill = None
    if args.sweep:
        best_knobs = sweep(args.shapes, g, rows)
    if args.sweep_prefill:
        best_prefill = sweep_prefill(args.shapes, g, rows)
    if args.kernels:
        for shape in args.shapes:
            b, t = (int(x) for x in shape.split("x"))
            fns, qkv, grads = paths(b, t, g)
            per = kernels_ms(fns["kernels (fused)"], qkv, grads, total=False)
            rows.append({"path": "kernels", "batch": b, "length": t, "kernel_ms": per})
            print(f"kernels of a fused forward + backward at {b}x{t} (ms per call; {sum(per.values()):.4f} in all):")
            for name, ms in list(per.items())[:14]:
                print(f"  {ms:8.4f}  {name[:90]}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "best": best_knobs,
                       "best_prefill": best_prefill}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
