"""Compile the window kernels for sm_90 here, with no GPU: does each variant build, and what does ptxas say of it?

The Triton interpreter checks the kernels' arithmetic on the CPU but is lenient about types; this builds the real PTX
for an H100/H200 (Triton's own ptxas) and prints registers and spills a variant: the prefill kernel
(``ops/window/parallel_triton.py``: RoPE in the kernel, with or without sinks and their own queries) and the ring step
(``ops/window/step_triton.py``: bf16 and float8 rings, whole or in parts, with or without the sinks' own queries or
their rotation in the kernel). A build error is a bug the next lease would meet; more spills are worth a look.
Arguments are specialised as the JIT specialises them on the SmolLM2 student's shapes (pointers 16-byte aligned, the
strides and sizes that are multiples of 16 marked so, unit strides fixed at 1): without that Triton loads the rings
element by element and the figures describe a kernel that never runs. ``--ptx`` also counts the loop's memory
instructions (e.g. a float8 ring's codes read from shared memory byte by byte into the product's layout).

    PYTHONPATH=src python dev/sm90_compile.py                 # every variant
    PYTHONPATH=src python dev/sm90_compile.py --step-block 32 # the ring step with blocks of 32 slots
    PYTHONPATH=src python dev/sm90_compile.py --step-block 64 --step-warps 2  # its crowded float8 tiles
    PYTHONPATH=src python dev/sm90_compile.py --fma --step-block 16 --ptx      # the products as broadcast sums
    PYTHONPATH=src python dev/sm90_compile.py --head-dim 128 --step-block 64 --merge-parts 4  # Llama 3's heads
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from linearize.ops.window import parallel_triton, step_triton


# The integer arguments that are multiples of 16 on the SmolLM2 student (head dim 64, 9 query / 3 key heads, q/k/v
# as views of one projection), and the unit strides, as the JIT sees them there
ALIGNED = {"_window_parallel": ("sq_b", "sq_h", "sq_t", "sk_b", "sk_h", "sk_t", "sv_b", "sv_h", "sv_t", "so_b", "so_h",
                                "so_t", "ss_b", "ss_h", "ss_t", "sc_t", "sp_t", "T", "D", "R"),
           "_window_ring_step": ("sq_b", "sq_h", "sk_b", "sk_h", "sv_b", "sv_h", "ss_b", "ss_h", "sc_b", "D", "L", "R")}
ONES = {"_window_ring_step": ("sq_d", "sk_d", "sv_d", "sc_d", "ss_d")}


def memory_ops(ptx: str) -> str:
    """How many of each global / shared memory instruction (``ldmatrix`` too) the PTX holds (predicated ones too)."""
    pattern = r"\b((?:ld|st|cp\.async)\.[a-z0-9.]*(?:global|shared)[a-z0-9.]*|ldmatrix\.[a-z0-9.]*)"
    ops = collections.Counter(m.group(1) for m in re.finditer(pattern, ptx))
    return ", ".join(f"{k} {v}" for k, v in sorted(ops.items()))


def build(kernel, pointers: dict, consts: dict, num_warps: int, ptx_ops: bool = False) -> str:
    """``kernel`` compiled for sm_90 with ``pointers`` typed (16-byte aligned) and ``consts`` fixed (other arguments
    32-bit integers, ``ALIGNED`` ones multiples of 16, ``ONES`` equal to 1; ``scale``/``softcap`` floats); ptxas'
    register and spill line (``ptx_ops``: and the PTX's memory instructions)."""
    names = list(kernel.arg_names)
    consts = {**consts, **{n: 1 for n in ONES.get(kernel.__name__, ())}}
    sig = {n: "constexpr" if n in consts else pointers.get(n, "fp32" if n in ("scale", "softcap") else "i32")
           for n in names}
    aligned = [n for n in names if n in pointers or n in ALIGNED.get(kernel.__name__, ())]
    src = triton.compiler.ASTSource(fn=kernel, signature=sig,
                                    constexprs={(names.index(c),): v for c, v in consts.items()},
                                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
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
    line = f"{used.group(1) if used else '?'} registers, spills {spill.group(1) if spill else '?'} B stored"
    return line + ("\n    " + memory_ops(compiled.asm["ptx"]) if ptx_ops else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--step-block", type=int, default=step_triton.STEP_BLOCK, help="the ring step's slots a block")
    p.add_argument("--step-warps", type=int, default=step_triton.STEP_WARPS, help="the ring step's warps")
    p.add_argument("--fma", action="store_true", help="the ring step's products as broadcast sums (STEP_MMA = False)")
    p.add_argument("--ptx", action="store_true", help="also count each variant's memory instructions")
    p.add_argument("--hold", action="store_true", help="a float8 ring's values held converted where loaded "
                   "(STEP_HOLD_VALUES)")
    p.add_argument("--head-dim", type=int, default=64, help="the ring step's head width (BD): 64 SmolLM2, 128 Llama 3")
    p.add_argument("--merge-parts", type=int, default=step_triton.MERGE_PARTS,
                   help="the parts the ring step's last part merges a tile at a time (BP)")
    a = p.parse_args()
    prefill = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", o_ptr="*bf16", mask_ptr="*u8", cos_ptr="*bf16",
                   sin_ptr="*bf16", pos_ptr="*i32", qs_ptr="*bf16", rc_ptr="*bf16", rs_ptr="*bf16", rp_ptr="*i64")
    for sinks, own, made in ((False, False, False), (True, False, False), (True, True, False), (True, False, True)):
        consts = dict(HAS_MASK=False, HAS_SOFTCAP=False, ROPE=True, F32_DOT=False, PREC="tf32", SINKS=sinks,
                      SINK_Q=own, SINK_ROPE=made, BS=16, BM=parallel_triton.PARALLEL_BM, BN=parallel_triton.PARALLEL_BN,
                      BD=64)
        print(f"prefill  sinks={sinks!s:5} own queries={'made' if made else own!s:5}:",
              build(parallel_triton._window_parallel, prefill, consts, parallel_triton.PARALLEL_WARPS, a.ptx))
    for fp8 in (False, True):
        ring = "*u8" if fp8 else "*bf16"
        step = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", keys_ptr=ring, values_ptr=ring, ks_ptr="*fp32",
                    vs_ptr="*fp32", valid_ptr="*i1", slot_ptr="*i64", o_ptr="*bf16", m_ptr="*fp32", l_ptr="*fp32",
                    acc_ptr="*fp32", cnt_ptr="*i32", cos_ptr="*bf16", sin_ptr="*bf16", qs_ptr="*bf16", rc_ptr="*fp32",
                    rs_ptr="*fp32", pos_ptr="*i64")
        for split in (False, True):
            for sink_q, sink_rope in ((False, False), (True, False), (False, True)):
                consts = dict(HAS_SOFTCAP=False, SPLIT=split, FP8=fp8, NATIVE_FP8=fp8, MMA=not a.fma,
                              F32_DOT=False, PREC="tf32", ROPE=True, SINK_Q=sink_q, SINK_ROPE=sink_rope,
                              HOLD_VALUES=a.hold, BG=4 if a.fma else 16, BW=a.step_block, BD=a.head_dim,
                              BP=a.merge_parts, SKIP_EMPTY=step_triton.STEP_SKIP_EMPTY, SCAN=1024)
                print(f"step     float8={fp8!s:5} parts={split!s:5} own queries={sink_q!s:5} "
                      f"rotated here={sink_rope!s:5}:", build(step_triton._window_ring_step, step, consts,
                                                             a.step_warps, a.ptx))


if __name__ == "__main__":
    main()
