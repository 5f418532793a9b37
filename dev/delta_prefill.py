"""Where the delta student's prefill time goes (issue #53: 0.88x the teacher at 1 x 32k, 0.40x at 32 x 1k at 9440fff,
where the default student is 2.47x / 1.09x). One prefill as ``linearize bench --prefill`` times it, with parts of
the delta hybrid swapped out in this process, so the difference to ``as-is`` is that part's cost:

  as-is           the checkpoint as it runs
  no-cache        called without a cache (no final state: no window/memory hand-over)
  no-memory       the delta memory's sequence form returns zeros (fla's kernels not run)
  no-window       the window's blocked SDPA returns zeros
  window-chunked  the window's softmax through the PyTorch chunked form instead of SDPA on blocks
  window-kernel   the window's softmax through the LoLCATs hybrid's Triton kernels, zero features (WINDOW_KERNEL)
  window-expanded the blocked SDPA with keys and values repeated to the query heads (no enable_gqa: SDPA's
                  memory-efficient kernel takes a mask, not groups)
  intracard       fla's intra-card context parallel for the memory (inference mode, one varlen sequence)

then the two parts alone on the layer's shapes (fla's chunk_gated_delta_rule; the blocked SDPA, and which SDPA
backends accept its call), then the kernels of one as-is prefill (torch.profiler, by CUDA time). The teacher's
prefill is timed in the same run. Prints a table; --out writes JSON.

    python dev/delta_prefill.py CK --teacher shape:smollm2-135m --shapes 1x32768 32x1024 --out X.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, warmup=2, repeats=5, budget_s=3.0):
    for _ in range(warmup):
        fn()
    sync()
    times = []
    while len(times) < repeats:
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
        if sum(times) > budget_s:
            break
    return 1000 * min(times)


@contextlib.contextmanager
def variant(name):
    from linearize.ops import window as WS
    from linearize.ops.delta import window as W

    saved = {"gated_delta_rule": W.gated_delta_rule}
    saved_ws = {k: getattr(WS, k) for k in ("window_softmax_sdpa", "WINDOW_SDPA", "WINDOW_KERNEL")}
    env = os.environ.get("FLA_INTRACARD_CP")
    try:
        if name == "no-memory":
            def zeros_rule(q, k, v, g, beta, *, output_final_state=False, **_):
                state = q.new_zeros(k.shape[0], k.shape[1], k.shape[-1], v.shape[-1], dtype=torch.float32)
                return q.new_zeros(*q.shape[:3], v.shape[-1]), (state if output_final_state else None)
            W.gated_delta_rule = zeros_rule
        elif name == "no-window":
            WS.window_softmax_sdpa = lambda q, k, v, **_: torch.zeros_like(q)
        elif name == "window-expanded":
            WS.window_softmax_sdpa = _expanded(saved_ws["window_softmax_sdpa"])
        elif name == "window-kernel":
            WS.WINDOW_KERNEL = True
        elif name == "window-chunked":
            WS.WINDOW_SDPA = False
        elif name == "intracard":
            os.environ["FLA_INTRACARD_CP"] = "1"
            W.gated_delta_rule = _varlen_rule(saved["gated_delta_rule"])
        yield
    finally:
        for k, v in saved.items():
            setattr(W, k, v)
        for k, v in saved_ws.items():
            setattr(WS, k, v)
        if env is None:
            os.environ.pop("FLA_INTRACARD_CP", None)
        else:
            os.environ["FLA_INTRACARD_CP"] = env


def _expanded(sdpa):
    def call(q, k, v, **kw):
        grp = q.shape[1] // k.shape[1]
        return sdpa(q, k.repeat_interleave(grp, dim=1), v.repeat_interleave(grp, dim=1), **kw)
    return call


def _varlen_rule(rule):
    """The memory as one varlen sequence per batch row (cu_seqlens), which fla's intra-card CP needs."""
    def varlen(q, k, v, g, beta, *, output_final_state=False, **kw):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        b, h, t, _ = q.shape
        n_kv = k.shape[1]
        grp = h // n_kv
        rep = lambda x: (x.repeat_interleave(grp, dim=2) if grp > 1 else x).contiguous()  # noqa: E731
        qh = q.transpose(1, 2).reshape(1, b * t, h, -1).contiguous()
        kh = rep(k.transpose(1, 2)).reshape(1, b * t, h, -1)
        vh = rep(v.transpose(1, 2)).reshape(1, b * t, h, -1)
        gh = rep(g.transpose(1, 2).float()).reshape(1, b * t, h)
        bh = rep(beta.transpose(1, 2).to(q.dtype)).reshape(1, b * t, h)
        cu = torch.arange(0, (b + 1) * t, t, device=q.device, dtype=torch.int32)
        with torch.inference_mode():
            o, ht = chunk_gated_delta_rule(qh, kh, vh, gh, bh, scale=1.0, cu_seqlens=cu,
                                           output_final_state=output_final_state)
        o = o.reshape(b, t, h, -1).transpose(1, 2)
        state = ht.view(b, n_kv, grp, *ht.shape[2:])[:, :, 0].float() if ht is not None else None
        return o.clone(), (state.clone() if state is not None else None)
    return varlen


def parts_alone(model, b, t):
    """fla's rule and the blocked SDPA alone at the model's delta shapes, once per layer's worth of calls."""
    from linearize.ops.delta.rule import gated_delta_rule_fla
    from linearize.ops.window import window_softmax_kernel, window_softmax_sdpa

    mixer = next(m for m in model.modules() if getattr(m, "kind", None) == "delta")
    g = mixer.geometry
    layers = sum(1 for m in model.modules() if getattr(m, "kind", None) == "delta")
    dev, dt = next(model.parameters()).device, torch.bfloat16
    h, hk, d = g.n_heads, g.n_kv_heads, g.head_dim
    q = torch.nn.functional.normalize(torch.randn(b, h, t, d, device=dev), dim=-1).to(dt)
    k = torch.nn.functional.normalize(torch.randn(b, hk, t, d, device=dev), dim=-1).to(dt)
    v = torch.randn(b, hk, t, d, device=dev, dtype=dt)
    gg = -torch.rand(b, hk, t, device=dev) * 0.1
    beta = torch.rand(b, hk, t, device=dev)
    out = {"layers": layers}
    try:
        out["fla_rule_ms"] = layers * timed(lambda: gated_delta_rule_fla(q, k, v, gg, beta, output_final_state=True))
    except Exception as e:  # no fla here
        out["fla_rule_ms"] = f"failed: {str(e).splitlines()[0][:120]}"
    out["window_sdpa_ms"] = layers * timed(lambda: window_softmax_sdpa(q, k, v, window=mixer.spec.window,
                                                                       scale=g.scaling))
    try:
        out["window_kernel_ms"] = layers * timed(lambda: window_softmax_kernel(q, k, v, window=mixer.spec.window,
                                                                               scale=g.scaling))
    except Exception as e:  # no Triton / CUDA here
        out["window_kernel_ms"] = f"failed: {str(e).splitlines()[0][:120]}"
    expanded = _expanded(window_softmax_sdpa)
    out["window_sdpa_expanded_ms"] = layers * timed(lambda: expanded(q, k, v, window=mixer.spec.window, scale=g.scaling))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    accepts = {}
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        try:
            with sdpa_kernel([getattr(SDPBackend, name)]):
                window_softmax_sdpa(q, k, v, window=mixer.spec.window, scale=g.scaling)
            accepts[name] = True
        except Exception as e:  # this backend refuses the call
            accepts[name] = str(e).splitlines()[0][:120]
        try:
            with sdpa_kernel([getattr(SDPBackend, name)]):
                expanded(q, k, v, window=mixer.spec.window, scale=g.scaling)
            accepts[name + " (expanded)"] = True
        except Exception as e:  # this backend refuses the call
            accepts[name] = str(e).splitlines()[0][:120]
    out["sdpa_backends"] = accepts
    return out


def kernels(fn, top):
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as p:
        fn()
        sync()
    rows = []
    for e in p.key_averages():
        cuda_us = getattr(e, "self_device_time_total", 0) if torch.cuda.is_available() else e.self_cpu_time_total
        if cuda_us:
            rows.append({"name": e.key[:90], "calls": e.count, "cuda_ms": cuda_us / 1000})
    rows.sort(key=lambda r: -r["cuda_ms"])
    return rows[:top]


def main(argv=None) -> int:
    import linearize
    from linearize.bench.prefill import prefill_once
    from linearize.decode.fused import fused_projections

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--teacher", default=None)
    p.add_argument("--shapes", nargs="+", default=["1x32768", "32x1024"])
    p.add_argument("--variants", nargs="+",
                   default=["as-is", "no-cache", "no-memory", "no-window", "window-chunked", "window-kernel",
                            "window-expanded", "intracard"])
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    model, _ = linearize.load_model(args.model, dtype="bfloat16", device=args.device)
    teacher = None
    if args.teacher:
        teacher, _ = linearize.load_teacher(args.teacher, dtype="bfloat16", device=args.device)
    result = []
    for shape in args.shapes:
        b, t = map(int, shape.split("x"))
        ids = torch.randint(0, model.config.vocab_size, (b, t), device=args.device)
        row = {"shape": shape}
        with torch.no_grad():
            if teacher is not None:
                row["teacher_ms"] = timed(lambda: prefill_once(teacher, ids))
            with fused_projections(model):
                for name in args.variants:
                    try:
                        with variant(name):
                            if name == "no-cache":
                                fn = lambda: model(ids, use_cache=False, logits_to_keep=1)  # noqa: E731
                            else:
                                fn = lambda: prefill_once(model, ids)  # noqa: E731
                            row[name] = timed(fn)
                    except Exception as e:  # a variant this machine cannot run
                        row[name] = f"failed: {str(e).splitlines()[0][:160]}"
                    print(f"{shape} {name}: {row[name]}", flush=True)
                row["parts_alone"] = parts_alone(model, b, t)
                print(f"{shape} parts alone: {row['parts_alone']}", flush=True)
                row["kernels"] = kernels(lambda: prefill_once(model, ids), args.top)
        for r in row["kernels"]:
            print(f"  {r['cuda_ms']:9.3f} ms {r['calls']:6d}x  {r['name']}")
        result.append(row)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
