"""The LoLCATs hybrid's whole-sequence kernels alone, at SmolLM2's attention shape (9 query heads on 3
key heads, head dim 64, Hedgehog features 2 x 64, window 64, bf16), on CUDA: milliseconds of the
forward and of forward + backward (median of ``triton.testing.do_bench``, compilation warmed up) for

* ``kernels (fused)``: RoPE and Hedgehog maps inside the forward kernels, from the projections' q/k/v
  (what the LoLCATs mixer runs);
* ``kernels (fused), PyTorch prelude``: the same forward; the backward recomputes RoPE and the maps
  in PyTorch (``hybrid_triton.FUSED_PRELUDE = False``) instead of the prelude's Triton kernels;
* ``kernels (features given)``: RoPE and the maps in PyTorch, the hybrid in the kernels (what pays:
  fusing the maps or not);
* ``torch chunked``: RoPE, the maps and ``hybrid_attention_chunked`` in PyTorch (before the kernels);
* ``teacher sdpa``: RoPE and causal softmax attention through SDPA with grouped keys (the teacher's).

    python dev/hybrid_bench.py [--shapes 1x1024 1x8192 32x1024 1x32768] [--sweep] [--out F]

``--sweep`` also times the fused forward and backward under each warp count and query / key
block of the kernels (``FWD_WARPS``/``BWD_WARPS``, ``QUERY_ROWS``, ``KEY_ROWS``; the defaults are
the fewest register spills of ``dev/hybrid_registers.py``) and prints the fastest.
"""

from __future__ import annotations

import argparse
import json

import torch

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
    from linearize.ops import hybrid_triton as hybrid_triton_module
    from linearize.ops.hybrid_triton import hedgehog_features, hybrid_triton, rope_half

    qkv, rope, wq, wk, logit = _inputs(b, t, g)
    kw = dict(window=W, scale=D ** -0.5)

    def fused(prelude=True):
        hybrid_triton_module.FUSED_PRELUDE = prelude  # read by the backward, which runs before the next path
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["1x1024", "1x8192", "32x1024", "1x32768"])
    p.add_argument("--skip", nargs="*", default=[], help="paths to leave out (e.g. 'torch chunked' at long lengths)")
    p.add_argument("--sweep", action="store_true", help="time the fused kernels under each warp count")
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
    if args.sweep:
        from linearize.ops import hybrid_triton

        saved = {n: getattr(hybrid_triton, n) for n in ("FWD_WARPS", "BWD_WARPS", "QUERY_ROWS", "KEY_ROWS")}
        for shape in args.shapes:
            b, t = (int(x) for x in shape.split("x"))
            fns, qkv, grads = paths(b, t, g)
            best = None
            for warps in (4, 8):
                for query_rows in (16, 32, 64):
                    for key_rows in (16, 32):
                        knobs = dict(FWD_WARPS=warps, BWD_WARPS=warps, QUERY_ROWS=query_rows, KEY_ROWS=key_rows)
                        for n, value in knobs.items():
                            setattr(hybrid_triton, n, value)
                        ms = (time_path(fns["kernels (fused)"], qkv, grads, False),
                              time_path(fns["kernels (fused)"], qkv, grads, True))
                        rows.append({"path": "sweep", "batch": b, "length": t, **knobs, "forward_ms": ms[0],
                                     "forward_backward_ms": ms[1]})
                        print(f"sweep {b}x{t} {knobs}: forward {ms[0]:.3f} ms, forward+backward {ms[1]:.3f} ms",
                              flush=True)
                        if best is None or ms[1] < best[0]:
                            best = (ms[1], knobs)
            print(f"fastest forward+backward at {b}x{t}: {best[1]}")
        for n, value in saved.items():
            setattr(hybrid_triton, n, value)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
