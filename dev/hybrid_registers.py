"""Registers and spills of the LoLCATs hybrid's Triton kernels for an H100 (sm_90), on a machine
without a GPU: each kernel is compiled through Triton's frontend and LLVM to PTX and assembled by
the ``ptxas`` Triton ships, whose ``-v`` report is printed (registers a thread, spilled bytes).
The tiles are SmolLM2's (window 64, head dim 64, Hedgehog features 2 x 64 or given ones of 128).

    PYTHONPATH=src python dev/hybrid_registers.py [--dtype bf16] [--warps 8] [--query-rows 32]
                                                     [--key-rows 16] [KERNEL ...]

Spills cost local-memory traffic in every program; the constants of ``ops/hybrid/chunk_triton.py`` are
the fewest-spill choices of this report (its comment lists them). Timings need the GPU:
``dev/hybrid_bench.py``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from linearize.ops.hybrid import chunk_triton as ht
from linearize.ops.hybrid import prelude_triton as hp

FP32_POINTERS = {"sums_ptr", "den_ptr", "mx_ptr", "gamma_ptr", "dq_ptr", "dqf_ptr", "rho_ptr", "dc_ptr", "dgamma_ptr",
                 "qsums_ptr", "rsums_ptr", "dk_ptr", "dv_ptr", "dkf_ptr", "src_ptr", "dst_ptr", "fin_ptr",
                 "w_ptr", "drot_ptr", "dfeat_ptr", "dw_ptr"}  # (the last: prelude_triton's)


def _ptxas() -> str:
    folder = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):  # the newest PTX version Triton emits needs the newer one
        if os.path.exists(os.path.join(folder, name)):
            return os.path.join(folder, name)
    raise SystemExit("no ptxas in this Triton installation")


def report(fn, consts: dict, warps: int, dtype: str) -> str:
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            ints = {"mask_ptr": "i1", "am_ptr": "i32", "slot_ptr": "i32", "sink_pos_ptr": "i32"}
            sig[name] = "*" + ints.get(name, "fp32" if name in FP32_POINTERS else dtype)
        elif name in ("scale", "softcap"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as fh:
        fh.write(kernel.asm["ptx"])
    out = subprocess.run([_ptxas(), "-arch=sm_90a", "-v", fh.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(fh.name)
    lines = [line.strip() for line in out.stderr.splitlines() if "spill" in line or "Used" in line]
    return " | ".join(lines) or out.stderr.strip()[-300:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kernels", nargs="*", default=["chunk_sums", "chunk_sums_sinks", "forward", "prefill", "prefill_sinks", "scan",
                                                  "backward_q", "backward_kv", "backward_kf", "prelude_forward",
                                                  "prelude_backward"])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--warps", type=int, default=None, help="default: the module's constants")
    p.add_argument("--query-rows", type=int, default=None, help="default: the module's constants for --dtype")
    p.add_argument("--key-rows", type=int, default=None, help="default: the module's constants for --dtype")
    args = p.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    kn, hn = ht._knobs(dtype), hp._knobs(dtype)  # the tiles the kernels take for inputs of that dtype
    query_rows, bwd_query_rows = args.query_rows or kn["QUERY_ROWS"], args.query_rows or kn["BWD_QUERY_ROWS"]
    key_rows = args.key_rows or kn["KEY_ROWS"]
    prec = "ieee" if args.dtype == "fp32" else "tf32"
    tiles = dict(BW=64, BD=64, PREC=prec)
    builds = []
    for hedgehog in (True, False):
        maps = dict(BF=64 if hedgehog else 128, ROPE=hedgehog, HEDGEHOG=hedgehog, FP=2 if hedgehog else 1, MASK=True)
        builds.append(("chunk_sums", ht._chunk_sums, {**tiles, **maps, "STATE": True, "SINKS": False}, kn["SUM_WARPS"]))
        if hedgehog:  # with the first tokens cached (their rows written beside the window's)
            builds.append(("chunk_sums_sinks", ht._chunk_sums, {**tiles, **maps, "STATE": True, "SINKS": True},
                           kn["SUM_WARPS"]))
        off = dict(SINKS=False, WINDOW_ANCHOR=False, BS=16)
        builds.append(("forward", ht._forward, {**tiles, **maps, "SOFTCAP": False, "SAVE": True, "LOGIT": True,
                                                "BQ": query_rows, **off}, kn["FWD_WARPS"]))
        if hedgehog:  # the prefill's output pass (no backward), without and with the first tokens cached
            for sinks in (False, True):
                builds.append((f"prefill{'_sinks' if sinks else ''}", ht._forward,
                               {**tiles, **maps, "SOFTCAP": False, "SAVE": False, "LOGIT": True,
                                "BQ": kn["PREFILL_QUERY_ROWS"], **off, "SINKS": sinks}, kn["PREFILL_WARPS"]))
    builds.append(("scan", ht._scan, dict(REVERSE=False, FINAL=True, BN=16, BE=512), 4))
    backward = dict(MASK=True, BW=64, BD=64, PREC=prec)
    builds.append(("backward_q", ht._backward_q, {**backward, "SOFTCAP": True, "BF": 128, "BQ": bwd_query_rows},
                   kn["BWD_WARPS"]))
    builds.append(("backward_kv", ht._backward_kv, {**backward, "SOFTCAP": True, "BK": key_rows, "G": 3},
                   kn["KEY_WARPS"]))
    builds.append(("backward_kf", ht._backward_kf, {**backward, "BF": 128, "BK": key_rows, "G": 3}, kn["KEY_WARPS"]))
    # the backward's fused prelude (prelude_triton): RoPE + Hedgehog maps, forward and backward
    prelude = dict(ROPE=True, BD=64, BF=64, PREC=prec)
    builds.append(("prelude_forward", hp._prelude_forward, {**prelude, "BT": hn["FWD_ROWS"]}, hn["FWD_WARPS"]))
    builds.append(("prelude_backward", hp._prelude_backward, {**prelude, "DROT": True, "DX": True, "DW": True,
                                                              "BT": hn["BWD_ROWS"]}, hn["BWD_WARPS"]))
    for name, fn, consts, warps in builds:
        if name in args.kernels:
            warps = args.warps or warps
            shown = {k: v for k, v in consts.items() if k not in ("BW", "BD", "PREC")}
            print(f"{name} ({args.dtype}, {warps} warps, {shown}):\n    {report(fn, consts, warps, args.dtype)}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
