"""Compile the window kernels for sm_90 here, with no GPU: does each variant build, and what does ptxas say of it?

The Triton interpreter checks the kernels' arithmetic on the CPU but is lenient about types; this builds the real PTX
for an H100/H200 (Triton's own ptxas) and prints registers and spills a variant: the prefill kernel
(``ops/window/parallel_triton.py``: RoPE in the kernel, with or without sinks and their own queries) and the ring step
(``ops/window/step_triton.py``: bf16 and float8 rings, whole or in parts, with or without the sinks' own queries or
their rotation in the kernel). A build error is a bug the next lease would meet; more spills are worth a look.

    PYTHONPATH=src python dev/sm90_compile.py                 # every variant
    PYTHONPATH=src python dev/sm90_compile.py --step-block 32 # the ring step with blocks of 32 slots
    PYTHONPATH=src python dev/sm90_compile.py --step-block 64 --step-warps 2  # its crowded float8 tiles
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from linearize.ops.window import parallel_triton, step_triton


def build(kernel, pointers: dict, consts: dict, num_warps: int) -> str:
    """``kernel`` compiled for sm_90 with ``pointers`` typed and ``consts`` fixed (other arguments 32-bit integers,
    ``scale``/``softcap`` floats); ptxas' register and spill line."""
    names = list(kernel.arg_names)
    sig = {n: "constexpr" if n in consts else pointers.get(n, "fp32" if n in ("scale", "softcap") else "i32")
           for n in names}
    src = triton.compiler.ASTSource(fn=kernel, signature=sig,
                                    constexprs={(names.index(c),): v for c, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")
    if not os.path.exists(ptxas):
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        done = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True)
    if done.returncode:
        return "ptxas failed: " + done.stderr.strip().splitlines()[-1]
    used = re.search(r"Used (\d+) registers", done.stderr)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", done.stderr)
    return f"{used.group(1) if used else '?'} registers, spills {spill.group(1) if spill else '?'} B stored"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--step-block", type=int, default=step_triton.STEP_BLOCK, help="the ring step's slots a block")
    p.add_argument("--step-warps", type=int, default=step_triton.STEP_WARPS, help="the ring step's warps")
    a = p.parse_args()
    prefill = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", o_ptr="*bf16", mask_ptr="*u8", cos_ptr="*bf16",
                   sin_ptr="*bf16", pos_ptr="*i32", qs_ptr="*bf16")
    for sinks, own in ((False, False), (True, False), (True, True)):
        consts = dict(HAS_MASK=False, HAS_SOFTCAP=False, ROPE=True, F32_DOT=False, PREC="tf32", SINKS=sinks,
                      SINK_Q=own, BS=16, BM=parallel_triton.PARALLEL_BM, BN=parallel_triton.PARALLEL_BN, BD=64)
        print(f"prefill  sinks={sinks!s:5} own queries={own!s:5}:",
              build(parallel_triton._window_parallel, prefill, consts, parallel_triton.PARALLEL_WARPS))
    for fp8 in (False, True):
        ring = "*u8" if fp8 else "*bf16"
        step = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", keys_ptr=ring, values_ptr=ring, ks_ptr="*fp32",
                    vs_ptr="*fp32", valid_ptr="*i1", slot_ptr="*i64", o_ptr="*bf16", m_ptr="*fp32", l_ptr="*fp32",
                    acc_ptr="*fp32", cos_ptr="*bf16", sin_ptr="*bf16", qs_ptr="*bf16", rc_ptr="*fp32",
                    rs_ptr="*fp32", pos_ptr="*i64")
        for split in (False, True):
            for sink_q, sink_rope in ((False, False), (True, False), (False, True)):
                consts = dict(HAS_SOFTCAP=False, SPLIT=split, FP8=fp8, NATIVE_FP8=fp8, MMA=step_triton.STEP_MMA,
                              F32_DOT=False, PREC="tf32", ROPE=True, SINK_Q=sink_q, SINK_ROPE=sink_rope,
                              BG=16, BW=a.step_block, BD=64)
                print(f"step     float8={fp8!s:5} parts={split!s:5} own queries={sink_q!s:5} "
                      f"rotated here={sink_rope!s:5}:", build(step_triton._window_ring_step, step, consts,
                                                             a.step_warps))


if __name__ == "__main__":
    main()
