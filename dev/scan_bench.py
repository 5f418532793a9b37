"""Time Mamba's Triton selective scan (``ops/selective_scan_triton.py``) on one CUDA GPU: forward and
forward + backward per call, at StripedMamba's shapes for SmolLM2 (Dn = 1152, N = 16), as the mixer
calls it (u, B, C and dt's projection in bf16, dt's softplus inside the kernels; a kernels file
without ``delta_softplus`` gets it in fp32 first), for the kernels' tunable constants
(``--sweep``), with each kernel's share of a forward + backward (``--kernels``).
Each config's outputs and gradients are checked against the first config's. Exits 1 without CUDA or
on a mismatch.

    python dev/scan_bench.py [--shapes 16x1024 2x8192] [--sweep] [--kernels] [--runs 10] [--module FILE]

``--module`` times another version of the kernels' file instead (e.g. one from git history or a
candidate); its outputs and gradients are also checked against linearize's kernels. The constants
it lacks show as -.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_bench import bench, parser  # noqa: E402

NAMES = ("CHUNK", "CKPT", "GROUP", "BLOCK_D", "FWD_BLOCK_D", "FWD_WARPS", "BWD_WARPS")
SWEEP = dict(CHUNK=[64, 128, 256], CKPT=[4, 8, 16, 32], GROUP=[4, 8], BLOCK_D=[16, 32, 64], FWD_BLOCK_D=[32, 64, 128],
             FWD_WARPS=[1, 2, 4], BWD_WARPS=[1, 2, 4])


def inputs(b, t, dn=1152, n=16):
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    u, B, C = r(b, t, dn).bfloat16(), r(b, t, n).bfloat16(), r(b, t, n).bfloat16()
    dt = (r(b, t, dn) * 0.5 - 4.0).bfloat16()  # dt_proj's output, before softplus
    A = -torch.arange(1, n + 1, device="cuda", dtype=torch.float32).repeat(dn, 1)
    D = torch.ones(dn, device="cuda")
    return [x.requires_grad_(True) for x in (u, dt, A, B, C, D)], r(b, t, dn).bfloat16()


def mixer_call(sst):
    """The module's scan as the mixer calls it: dt before its softplus, which the kernels apply
    (``delta_softplus``; older kernel files get it in PyTorch, in fp32, first)."""
    if "delta_softplus" in inspect.signature(sst.selective_scan_triton).parameters:
        return lambda u, dt, *rest: sst.selective_scan_triton(u, dt, *rest, delta_softplus=True)
    return lambda u, dt, *rest: sst.selective_scan_triton(u, torch.nn.functional.softplus(dt.float()), *rest)


def against_linearize(scan, case) -> bool:
    """Whether the module's output and gradients differ from linearize's kernels' by more than 2 %."""
    import linearize.ops.selective_scan_triton as ours

    results = []
    for fn in (scan, mixer_call(ours)):
        _, xs, dy = case()
        y = fn(*xs)[0]
        results.append([y.float(), *(g.float() for g in torch.autograd.grad(y, xs, dy))])
    diff = max(((a - e).norm() / e.norm()).item() for a, e in zip(*results))
    print(f"  against linearize's kernels: rel diff {diff:.1e} (y and every gradient)")
    return diff > 2e-2


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument("--module", default=None, help="a kernels file to time instead of linearize's")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("scan_bench: needs a CUDA GPU", file=sys.stderr)
        return 1
    if args.module:
        import importlib.util

        spec = importlib.util.spec_from_file_location("scan_under_test", args.module)
        sst = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sst)
    else:
        import linearize.ops.selective_scan_triton as sst

    scan = mixer_call(sst)
    print(args.module or "linearize.ops.selective_scan_triton")

    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    bad = False
    for shape in args.shapes:
        b, t = map(int, shape.split("x"))

        def case():
            xs, dy = inputs(b, t)
            return (lambda: scan(*xs)[0]), xs, dy

        if args.module:
            bad |= against_linearize(scan, case)
        bad |= bench(sst, NAMES, SWEEP, case, f"{b} x {t} x 1152 x 16", sweep=args.sweep, kernels=args.kernels,
                     runs=args.runs)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
