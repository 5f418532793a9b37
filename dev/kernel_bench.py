"""What the kernel benchmarks share: timing an op's forward and forward + backward on CUDA for each setting of
its kernels' module-level constants, checking every setting's outputs and gradients against the first one's,
and listing each kernel's device time (``scan_bench.py``, ``conv_bench.py``); a decode step's time replayed
from one CUDA graph (``graph_us``: ``step_bench.py``, ``window_step_bench.py``)."""

from __future__ import annotations

import argparse
import collections
import statistics

import torch


def parser(doc: str) -> argparse.ArgumentParser:
    """The options both benchmarks take, under ``doc``'s first paragraph."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["16x1024", "2x8192"], help="batch x tokens")
    p.add_argument("--sweep", action="store_true", help="also vary one constant at a time around the defaults")
    p.add_argument("--kernels", action="store_true", help="print each kernel's time in a forward + backward")
    p.add_argument("--runs", type=int, default=10, help="timed calls per config (median)")
    return p


def timed(fn, runs):
    """Median milliseconds of ``fn`` over ``runs`` calls, after two warm-up calls."""
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


def row(names, cfg):
    """A config's constants under their names' columns (- where unset or the module lacks one)."""
    return " ".join(f"{'-' if v is None else v:>{len(k)}}" for k, v in zip(names, cfg))


def configs_of(module, names, sweep_values, sweep):
    """The module's current constants, then (``sweep``) each constant's other values one at a time."""
    default = tuple(getattr(module, k, None) for k in names)
    configs = [default]
    if sweep:
        for i, k in enumerate(names):
            configs += [default[:i] + (v,) + default[i + 1:] for v in sweep_values[k] if v != default[i]]
    return default, configs


def bench(module, names, sweep_values, case, label, *, sweep, kernels, runs) -> bool:
    """Time ``case()`` = ``(run, leaves, dy)`` (``run()`` returns the op's output; its gradient
    towards ``leaves`` is taken with ``dy``) for each config; with ``sweep``, also every constant at
    its fastest value together. Restores the module's constants; returns whether any config's
    results differed from the first one's by more than 2 % (relative)."""
    default, configs = configs_of(module, names, sweep_values, sweep)
    run, leaves, dy = case()

    def fwd():
        with torch.no_grad():
            return run()

    def both():
        return torch.autograd.grad(run(), leaves, dy)

    def use(cfg):
        for k, v in zip(names, cfg):
            setattr(module, k, v)

    print(f"\n{label}: " + " ".join(names) + "   fwd ms   fwd+bwd ms   rel diff")
    ref, results, bad = None, {}, False
    for cfg in configs:
        use(cfg)
        got = [run().float(), *(g.float() for g in both())]
        ref = ref or got
        diff = max(((a - e).norm() / e.norm()).item() for a, e in zip(got, ref))
        bad |= diff > 2e-2
        f_ms, fb_ms = timed(fwd, runs), timed(both, runs)
        results[cfg] = fb_ms
        print(f"  {row(names, cfg)}   {f_ms:6.3f}   {fb_ms:9.3f}   {diff:.1e}", flush=True)
    if sweep:
        others_default = lambda c, i: all(c[j] == default[j] for j in range(len(names)) if j != i)  # noqa: E731
        best = tuple(min((c for c in results if others_default(c, i)), key=results.get)[i] for i in range(len(names)))
        if best not in results:
            use(best)
            results[best] = timed(both, runs)
            print(f"  {row(names, best)}   (combined) {results[best]:9.3f}")
        fastest = min(results, key=results.get)
        print(f"  fastest: {dict(zip(names, fastest))} at {results[fastest]:.3f} ms fwd+bwd")
    use(default)
    if kernels:
        print("  per kernel, fwd+bwd, defaults:")
        for name, ms in kernel_ms(both, runs).items():
            print(f"    {ms:7.3f} ms  {name[:90]}")
    return bad


# query heads, key heads and head dim of the named shapes' attention, for the step benches' --shape
HEADS = {"smollm2-135m": (9, 3, 64), "llama-3.2-1b": (32, 8, 64), "llama-3-8b": (32, 8, 128), "llama-3-70b": (64, 8, 128)}


def graph_us(step, replays):
    """µs per replay of ``step`` captured in one CUDA graph (on the CPU: per plain call)."""
    if not torch.cuda.is_available():
        import time

        t = time.perf_counter()
        for _ in range(replays):
            step()
        return (time.perf_counter() - t) * 1e6 / replays
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(replays):
        graph.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) * 1e3 / replays
