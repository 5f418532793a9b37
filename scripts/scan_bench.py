"""Time Mamba's Triton selective scan (``ops/selective_scan_triton.py``) on one CUDA GPU: forward and
forward + backward per call, at StripedMamba's shapes for SmolLM2 (Dn = 1152, N = 16), as the mixer
calls it (u, B, C and dt's projection in bf16, dt's softplus in fp32 first), for the kernels'
tunable constants (``--sweep``), with each kernel's share of a forward + backward (``--kernels``).
Each config's outputs and gradients are checked against the first config's. Exits 1 without CUDA or
on a mismatch.

    python scripts/scan_bench.py [--shapes 16x1024 2x8192] [--sweep] [--kernels] [--runs 10] [--module FILE]

``--module`` times another version of the kernels' file instead (e.g. one from git history); the
constants it lacks show as -.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys

import torch

NAMES = ("CHUNK", "CKPT", "GROUP", "BLOCK_D", "FWD_WARPS", "BWD_WARPS", "BWD_MAXNREG")
SWEEP = dict(CHUNK=[64, 128, 256], CKPT=[8, 16, 32], GROUP=[4, 8], BLOCK_D=[16, 32, 64, 128], FWD_WARPS=[1, 2, 4, 8],
             BWD_WARPS=[1, 2, 4, 8], BWD_MAXNREG=[None, 128, 168])


def inputs(b, t, dn=1152, n=16):
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    u, B, C = r(b, t, dn).bfloat16(), r(b, t, n).bfloat16(), r(b, t, n).bfloat16()
    dt = (r(b, t, dn) * 0.5 - 4.0).bfloat16()  # dt_proj's output, before softplus
    A = -torch.arange(1, n + 1, device="cuda", dtype=torch.float32).repeat(dn, 1)
    D = torch.ones(dn, device="cuda")
    return [x.requires_grad_(True) for x in (u, dt, A, B, C, D)], r(b, t, dn).bfloat16()


def row(cfg):
    """A config's constants under their names' columns (- where unset or the kernels' file lacks one)."""
    return " ".join(f"{'-' if v is None else v:>{len(k)}}" for k, v in zip(NAMES, cfg))


def timed(fn, runs):
    for _ in range(2):
        fn()
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def kernel_ms(fn, runs):
    """Device time per call of each kernel ``fn`` launches, in ms, by the profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    total = collections.Counter()
    for e in prof.events():
        if e.device_type.name == "CUDA":
            total[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return {k: v / runs / 1e3 for k, v in total.most_common()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["16x1024", "2x8192"], help="batch x tokens")
    p.add_argument("--sweep", action="store_true", help="also vary one constant at a time around the defaults")
    p.add_argument("--kernels", action="store_true", help="print each kernel's time in a forward + backward")
    p.add_argument("--runs", type=int, default=10)
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

    def scan(u, dt, *rest):  # as the mixer calls it: dt's softplus in fp32 first
        return sst.selective_scan_triton(u, torch.nn.functional.softplus(dt.float()), *rest)
    print(args.module or "linearize.ops.selective_scan_triton")

    default = tuple(getattr(sst, k, None) for k in NAMES)
    configs = [default]
    if args.sweep:  # one constant at a time, then the best of each together
        for i, k in enumerate(NAMES):
            configs += [default[:i] + (v,) + default[i + 1:] for v in SWEEP[k] if v != default[i]]
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    bad = False
    for shape in args.shapes:
        b, t = map(int, shape.split("x"))
        xs, dy = inputs(b, t)
        ref = None
        print(f"\n{b} x {t} x 1152 x 16: " + " ".join(NAMES) + "   fwd ms   fwd+bwd ms   rel diff")
        results = {}
        for cfg in configs:
            for k, v in zip(NAMES, cfg):
                setattr(sst, k, v)

            def fwd():
                with torch.no_grad():
                    return scan(*xs)

            def both():
                y, _ = scan(*xs)
                return torch.autograd.grad(y, xs, dy)

            y, _ = scan(*xs)
            got = [y.float(), *(g.float() for g in torch.autograd.grad(y, xs, dy))]
            ref = ref or got
            diff = max(((a - e).norm() / e.norm()).item() for a, e in zip(got, ref))
            f_ms, fb_ms = timed(fwd, args.runs), timed(both, args.runs)
            bad |= diff > 2e-2
            results[cfg] = fb_ms
            print(f"  {row(cfg)}   {f_ms:6.3f}   {fb_ms:9.3f}   {diff:.1e}",
                  flush=True)
        if args.sweep:  # each constant at its fastest value, together
            best = tuple(min((c for c in results if all(c[j] == default[j] for j in range(len(NAMES)) if j != i)),
                             key=results.get)[i] for i in range(len(NAMES)))
            if best not in results:
                for k, v in zip(NAMES, best):
                    setattr(sst, k, v)
                results[best] = timed(both, args.runs)
                print(f"  {row(best)}   (combined) {results[best]:9.3f}")
            fastest = min(results, key=results.get)
            print(f"  fastest: {dict(zip(NAMES, fastest))} at {results[fastest]:.3f} ms fwd+bwd")
        if args.kernels:
            for k, v in zip(NAMES, default):
                setattr(sst, k, v)
            print("  per kernel, fwd+bwd, defaults:")
            for name, ms in kernel_ms(both, args.runs).items():
                print(f"    {ms:7.3f} ms  {name[:90]}")
    for k, v in zip(NAMES, default):
        setattr(sst, k, v)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
