"""Time Mamba's fused causal conv1d + SiLU (``ops/causal_conv1d_triton.py``) on one CUDA GPU: forward
and forward + backward per call at StripedMamba's shapes for SmolLM2 (Dn = 1152, K = 4; x a column
slice of the [B, T, 2 Dn] input projection, bf16, as the mixer passes it), for the kernels' tile
constants (``--sweep``, forward and backward ones apart), with each kernel's share (``--kernels``).
Each config's outputs and gradients are checked against the first config's. Exits 1 without CUDA or
on a mismatch.

    python scripts/conv_bench.py [--shapes 16x1024 2x8192] [--sweep] [--kernels] [--runs 10]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scan_bench import kernel_ms, timed  # noqa: E402

NAMES = ("BLOCK_T", "BLOCK_D", "NUM_WARPS", "BWD_BLOCK_T", "BWD_BLOCK_D", "BWD_NUM_WARPS")
SWEEP = dict(BLOCK_T=[32, 64, 128], BLOCK_D=[32, 64, 128], NUM_WARPS=[2, 4, 8],
             BWD_BLOCK_T=[16, 32, 64, 128], BWD_BLOCK_D=[16, 32, 64, 128], BWD_NUM_WARPS=[1, 2, 4, 8])


def inputs(b, t, dn=1152, k=4):
    """The input projection's output (the op reads its first half), weight, bias and dy."""
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    proj = r(b, t, 2 * dn).bfloat16().requires_grad_(True)
    w, bias = (r(dn, 1, k) * 0.5).requires_grad_(True), r(dn).requires_grad_(True)
    return proj, w, bias, r(b, t, dn).bfloat16()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["16x1024", "2x8192"], help="batch x tokens")
    p.add_argument("--sweep", action="store_true", help="also vary one constant at a time around the defaults")
    p.add_argument("--kernels", action="store_true", help="print each kernel's time in a forward + backward")
    p.add_argument("--runs", type=int, default=10)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("conv_bench: needs a CUDA GPU", file=sys.stderr)
        return 1
    import linearize.ops.causal_conv1d_triton as cct

    default = tuple(getattr(cct, k) for k in NAMES)
    configs = [default]
    if args.sweep:
        for i, k in enumerate(NAMES):
            configs += [default[:i] + (v,) + default[i + 1:] for v in SWEEP[k] if v != default[i]]
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    bad = False
    for shape in args.shapes:
        b, t = map(int, shape.split("x"))
        proj, w, bias, dy = inputs(b, t)
        dn = w.shape[0]
        ref = None
        print(f"\n{b} x {t} x {dn}, K = {w.shape[-1]}: " + " ".join(NAMES) + "   fwd ms   fwd+bwd ms   rel diff")
        results = {}
        for cfg in configs:
            for k, v in zip(NAMES, cfg):
                setattr(cct, k, v)

            def fwd():
                with torch.no_grad():
                    return cct.causal_conv1d_silu_triton(proj[..., :dn], w, bias)

            def both():
                y, _ = cct.causal_conv1d_silu_triton(proj[..., :dn], w, bias)
                return torch.autograd.grad(y, (proj, w, bias), dy)

            y, _ = cct.causal_conv1d_silu_triton(proj[..., :dn], w, bias)
            got = [y.float(), *(g.float() for g in torch.autograd.grad(y, (proj, w, bias), dy))]
            ref = ref or got
            diff = max(((a - e).norm() / e.norm()).item() for a, e in zip(got, ref))
            f_ms, fb_ms = timed(fwd, args.runs), timed(both, args.runs)
            bad |= diff > 2e-2
            results[cfg] = (f_ms, fb_ms)
            print(f"  {' '.join(f'{v:>{len(k)}}' for k, v in zip(NAMES, cfg))}   {f_ms:6.3f}   {fb_ms:9.3f}   {diff:.1e}",
                  flush=True)
        if args.sweep:
            fastest = min(results, key=lambda c: results[c][1])
            print(f"  fastest fwd+bwd: {dict(zip(NAMES, fastest))} at {results[fastest][1]:.3f} ms")
        if args.kernels:
            for k, v in zip(NAMES, default):
                setattr(cct, k, v)

            def both():
                y, _ = cct.causal_conv1d_silu_triton(proj[..., :dn], w, bias)
                return torch.autograd.grad(y, (proj, w, bias), dy)

            print("  per kernel, fwd+bwd, defaults:")
            for name, ms in kernel_ms(both, args.runs).items():
                print(f"    {ms:7.3f} ms  {name[:90]}")
    for k, v in zip(NAMES, default):
        setattr(cct, k, v)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
