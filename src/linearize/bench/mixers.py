"""Kernel and mixer timings against SDPA softmax attention, and the fla-vs-PyTorch agreement.

    python -m linearize.bench.mixers [--lengths 1024 4096 16384] [--tokens 32768] [--out results.json]

Needs CUDA. Two tables, both causal, bf16, batch x length = ``--tokens``, median ms of forward and
forward+backward (``triton.testing.do_bench``, after a warm-up that also absorbs fla's autotuning):

* ops: the bare attention math at H=16 heads, head dim 64 (the shape of ../shared/ANCHORS.md):
  SDPA, the fla path and the PyTorch chunked path of normalised and decayed linear attention,
  and the LoLCATs hybrid (PyTorch chunked; feature dim 2x64).
* mixers: one whole attention layer of SmolLM2-135M's shape (576 wide, 9 query / 3 key heads,
  head dim 64, random weights): the teacher's attention vs each mixer, projections included
  (the LoLCATs hybrid with a sparse cache and the delta-rule window run their PyTorch selection
  loop / fla's chunk_gated_delta_rule).

The agreement table gives ||fla - torch|| / ||torch|| for outputs, final states and input
gradients, in fp32 and bf16.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time

import torch


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def agreement(device="cuda", dtypes=(torch.float32, torch.bfloat16), report=None) -> list[dict]:
    """fla path vs PyTorch chunked path on odd shapes (GQA, T not a multiple of 64, initial state).

    ``report`` is called with each row as soon as it is measured (a slow compilation then shows
    which case it is stuck on)."""
    from linearize import ops

    rows = []
    g = torch.Generator(device=device).manual_seed(0)
    b, h, hk, t, f, d = 2, 8, 2, 1000, 64, 64
    cases = {
        "normalised (LoLCATs linear)": dict(log_decay=None, normalize=True),
        "decayed (SUPRA)": dict(log_decay=torch.log1p(-(2.0 ** (-5.0 - torch.arange(h, device=device)))), normalize=False),
        "decayed + normalised": dict(log_decay=torch.log1p(-(2.0 ** (-5.0 - torch.arange(h, device=device)))), normalize=True),
    }
    for dtype in dtypes:
        for name, kw in cases.items():
            q = (torch.randn(b, h, t, f, device=device, generator=g) * 0.5).exp().mul(0.1).to(dtype).requires_grad_()
            k = (torch.randn(b, hk, t, f, device=device, generator=g) * 0.5).exp().mul(0.1).to(dtype).requires_grad_()
            v = torch.randn(b, hk, t, d, device=device, generator=g).to(dtype).requires_grad_()
            groups = h // hk if kw["log_decay"] is not None else 1
            s0 = torch.rand(b, hk, groups, f, d + int(kw["normalize"]), device=device, generator=g) * 0.1
            do = torch.randn(b, h, t, d, device=device, generator=g).to(dtype)
            outs = {}
            for backend in ("fla", "torch"):
                o, st = ops.linear_attention(q, k, v, **kw, initial_state=s0, output_final_state=True, backend=backend)
                grads = torch.autograd.grad((o.float() * do.float()).sum(), (q, k, v))
                outs[backend] = (o, st, grads)
            (o1, s1, g1), (o2, s2, g2) = outs["fla"], outs["torch"]
            rows.append({
                "case": name, "dtype": str(dtype).replace("torch.", ""),
                "out": _rel(o1, o2), "state": _rel(s1, s2),
                "grad_q": _rel(g1[0], g2[0]), "grad_k": _rel(g1[1], g2[1]), "grad_v": _rel(g1[2], g2[2]),
            })
            if report is not None:
                report(rows[-1])
    return rows


def _time(fn, backward: bool) -> float:
    import triton.testing

    def run():
        out = fn()
        if backward:
            out.float().sum().backward()

    run()  # compile / autotune outside the timing
    return triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")


def op_timings(lengths, tokens, device="cuda") -> list[dict]:
    from linearize import ops

    h, d = 16, 64
    rows = []
    for t in lengths:
        b = max(tokens // t, 1)
        mk = lambda *s: torch.randn(*s, device=device, dtype=torch.bfloat16).requires_grad_()  # noqa: E731
        q, k, v = mk(b, h, t, d), mk(b, h, t, d), mk(b, h, t, d)
        qf, kf = (torch.softmax(x.detach(), -1).requires_grad_() for x in (q, k))
        qf2, kf2 = (torch.softmax(torch.randn(b, h, t, 2 * d, device=device, dtype=torch.bfloat16), -1).requires_grad_() for _ in range(2))
        gamma = torch.full((h,), 0.1, device=device)
        ld = torch.log1p(-(2.0 ** (-5.0 - torch.arange(h, device=device))))
        fns = {
            "sdpa softmax": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
            "fla decayed (supra)": lambda: ops.linear_attention(qf, kf, v, log_decay=ld, normalize=False, backend="fla")[0],
            "fla normalised (linear)": lambda: ops.linear_attention(qf, kf, v, backend="fla")[0],
            "torch chunked decayed": lambda: ops.linear_attention(qf, kf, v, log_decay=ld, normalize=False, backend="torch")[0],
            "torch chunked normalised": lambda: ops.linear_attention(qf, kf, v, backend="torch")[0],
            "torch lolcats hybrid (w=64, F=128)": lambda: ops.hybrid_attention_chunked(q, k, qf2, kf2, v, gamma, window=64, scale=d ** -0.5)[0],
        }
        for name, fn in fns.items():
            rows.append(_report({"table": "ops", "what": name, "T": t, "B": b, **_fwd_bwd(fn)}))
    return rows


def _report(row: dict) -> dict:
    print(json.dumps(row), flush=True)
    return row


def _fwd_bwd(fn) -> dict:
    try:
        return {"fwd_ms": _time(fn, False), "fwd_bwd_ms": _time(fn, True)}
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {"fwd_ms": math.nan, "fwd_bwd_ms": math.nan, "note": "out of memory"}


def mixer_timings(lengths, tokens, device="cuda") -> list[dict]:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    from linearize.mixers import MIXERS
    from linearize.models import get_adapter
    from linearize.spec import Spec

    cfg = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      intermediate_size=1536, rope_theta=1e5, num_hidden_layers=30)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    attn = LlamaAttention(cfg, 0).to(device, torch.bfloat16)
    rope = LlamaRotaryEmbedding(cfg).to(device)
    adapter = get_adapter(cfg)
    geometry = adapter.geometry(attn, cfg)
    modules = {"teacher attention (sdpa)": attn}
    for label, spec in {
        "lolcats hybrid (hedgehog, w=64)": {"kind": "lolcats"},
        "linear (hedgehog)": {"kind": "linear"},
        "supra (t2r, retnet decay, groupnorm)": {"kind": "supra"},
        "lolcats + sparse cache (S=64)": {"kind": "lolcats", "sparse_cache": 64},
        "delta (window + gated delta rule)": {"kind": "delta"},
    }.items():
        s = Spec.coerce(spec)
        modules[label] = MIXERS[s.kind](attn, adapter, geometry, s, 3, 30).to(device)
    rows = []
    for t in lengths:
        b = max(tokens // t, 1)
        x = torch.randn(b, t, 576, device=device, dtype=torch.bfloat16, requires_grad=True)
        pos = rope(x, torch.arange(t, device=device)[None])
        for name, module in modules.items():
            fn = lambda m=module: m(x, position_embeddings=pos, attention_mask=None)[0]  # noqa: E731
            rows.append(_report({"table": "mixers", "what": name, "T": t, "B": b, **_fwd_bwd(fn)}))
    return rows


def markdown(agree: list[dict], timings: list[dict]) -> str:
    lines = ["| case | dtype | out | final state | grad q | grad k | grad v |", "|---|---|---|---|---|---|---|"]
    for r in agree:
        lines.append(f"| {r['case']} | {r['dtype']} | {r['out']:.1e} | {r['state']:.1e} | {r['grad_q']:.1e} | {r['grad_k']:.1e} | {r['grad_v']:.1e} |")
    for table in ("ops", "mixers"):
        rows = [r for r in timings if r["table"] == table]
        if not rows:
            continue
        lengths = sorted({r["T"] for r in rows})
        names = list(dict.fromkeys(r["what"] for r in rows))
        lines += ["", f"{table}: median ms forward / forward+backward", "",
                  "| " + table + " | " + " | ".join(f"T={t} (B={next(r['B'] for r in rows if r['T'] == t)})" for t in lengths) + " |",
                  "|---" * (len(lengths) + 1) + "|"]
        for n in names:
            cells = []
            for t in lengths:
                r = next(r for r in rows if r["what"] == n and r["T"] == t)
                cells.append(f"{r['fwd_ms']:.2f} / {r['fwd_bwd_ms']:.2f}")
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m linearize.bench.mixers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384], help="sequence lengths T")
    p.add_argument("--tokens", type=int, default=32768, help="batch x length per measurement")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument("--skip-timing", action="store_true", help="only the fla-vs-torch agreement")
    p.add_argument("--skip-agreement", action="store_true", help="only the timings")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"],
                   help="dtypes of the agreement check (default: %(default)s)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("linearize.bench.mixers: error: needs a CUDA GPU")
    from linearize.ops import fla_available
    if not fla_available():
        raise SystemExit("linearize.bench.mixers: error: needs flash-linear-attention (pip install 'linearize[cuda]')")
    start = time.time()
    agree = [] if a.skip_agreement else agreement(dtypes=[getattr(torch, d) for d in a.dtypes], report=_report)
    timings = [] if a.skip_timing else op_timings(a.lengths, a.tokens) + mixer_timings(a.lengths, a.tokens)
    import fla
    import transformers
    import triton
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "fla": getattr(fla, "__version__", "?"), "transformers": transformers.__version__,
            "python": platform.python_version(), "seconds": round(time.time() - start, 1)}
    print(json.dumps(meta))
    print(markdown(agree, timings))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"meta": meta, "agreement": agree, "timings": timings}, fh, indent=1)


if __name__ == "__main__":
    main()
