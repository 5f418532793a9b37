"""The decode steps' Triton kernels build for an H100/H200 (sm_90) here, with no GPU.

Triton's interpreter, which the other kernel tests run on the CPU, runs a kernel as Python and lets through what
the compiler refuses (a name that an ``if`` block gives another type than it had before the block, for one: the
float8 ring step of 8f4ece1 failed so on the GPU alone). Compiling to PTX for sm_90 needs no GPU and finds such
errors; the variants built are the ones the fast decoder launches at Llama-3 shapes (head dim 128, blocks of 64)."""

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402

from linearize.ops.hybrid import step_triton as hybrid_step  # noqa: E402
from linearize.ops.window import step_triton as window_step  # noqa: E402

FLOATS = ("scale", "softcap")


def _build(kernel, pointers: dict, consts: dict, num_warps: int = 4) -> None:
    """``kernel`` compiled to PTX for sm_90: ``pointers`` typed as given, ``consts`` fixed, the other arguments
    32-bit integers (``scale``/``softcap`` floats)."""
    names = list(kernel.arg_names)
    sig = {n: "constexpr" if n in consts else pointers.get(n, "fp32" if n in FLOATS else "i32") for n in names}
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs={(names.index(c),): v for c, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
    assert f".entry {kernel.__name__}" in compiled.asm["ptx"]


WINDOW_POINTERS = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", ks_ptr="*fp32", vs_ptr="*fp32", valid_ptr="*i1",
                       slot_ptr="*i64", o_ptr="*bf16", m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", cnt_ptr="*i32",
                       cos_ptr="*bf16", sin_ptr="*bf16", qs_ptr="*bf16", rc_ptr="*fp32", rs_ptr="*fp32",
                       pos_ptr="*i64")


@pytest.mark.parametrize("float8", [False, True])
@pytest.mark.parametrize("split", [False, True])
def test_window_ring_step_builds_for_sm90(float8, split):
    ring = "*u8" if float8 else "*bf16"
    consts = dict(HAS_SOFTCAP=False, SPLIT=split, FP8=float8, NATIVE_FP8=float8, MMA=True, F32_DOT=False, PREC="tf32",
                  ROPE=True, SINK_Q=False, SINK_ROPE=split, HOLD_VALUES=float8, SKIP_EMPTY=True, BG=16, BW=64, BD=128,
                  BP=1, SCAN=1024)
    _build(window_step._window_ring_step, {**WINDOW_POINTERS, "keys_ptr": ring, "values_ptr": ring}, consts, 2)


HYBRID_POINTERS = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16", wq_ptr="*bf16",
                       wk_ptr="*bf16", logit_ptr="*bf16", keys_ptr="*bf16", values_ptr="*bf16", valid_ptr="*i1",
                       lin_ptr="*fp32", slot_ptr="*i64", ticks_ptr="*i32", y_ptr="*bf16", sinkk_ptr="*bf16",
                       sinkv_ptr="*bf16", sinkm_ptr="*i1", lg_ptr="*bf16", gb_ptr="*bf16", ek_ptr="*fp32",
                       ev_ptr="*fp32", kf_ptr="*bf16")


@pytest.mark.parametrize("layout, chunk", [("default", 32), ("plain", 128), ("sinks", 32)])
def test_fused_hybrid_step_builds_for_sm90(layout, chunk):
    """The default student's step (gated from the projection's output, features before RoPE), plain LoLCATs', and
    one with attention sinks anchored to the window; value columns in chunks of 32, or whole."""
    default, sinks = layout == "default", layout == "sinks"
    consts = dict(HAS_SOFTCAP=sinks, BW=64, BD=128, BDV=128, BF=64, BS=4 if sinks else 0, WINDOW_ANCHOR=sinks,
                  GATED=default, NOPE=default, GATE_INPUT=default, BC=chunk, WIDTH=132)
    _build(hybrid_step._hybrid_fused_step, HYBRID_POINTERS, consts, 4)
