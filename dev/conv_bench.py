"""Time Mamba's fused causal conv1d + SiLU (``ops/causal_conv1d_triton.py``) on one CUDA GPU: forward
and forward + backward per call at StripedMamba's shapes for SmolLM2 (Dn = 1152, K = 4; x a column
slice of the [B, T, 2 Dn] input projection, bf16, as the mixer passes it), for the kernels' tile
constants (``--sweep``, forward and backward ones apart), with each kernel's share (``--kernels``).
Each config's outputs and gradients are checked against the first config's. Exits 1 without CUDA or
on a mismatch.

    python dev/conv_bench.py [--shapes 16x1024 2x8192] [--sweep] [--kernels] [--runs 10]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_bench import bench, parser  # noqa: E402

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
    p = parser(__doc__)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("conv_bench: needs a CUDA GPU", file=sys.stderr)
        return 1
    import linearize.ops.causal_conv1d_triton as cct

    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    bad = False
    for shape in args.shapes:
        b, t = map(int, shape.split("x"))

        def case():
            proj, w, bias, dy = inputs(b, t)
            dn = w.shape[0]
            return (lambda: cct.causal_conv1d_silu_triton(proj[..., :dn], w, bias)[0]), (proj, w, bias), dy

        bad |= bench(cct, NAMES, SWEEP, case, f"{b} x {t} x 1152, K = 4", sweep=args.sweep, kernels=args.kernels,
                     runs=args.runs)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
