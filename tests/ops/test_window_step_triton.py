"""The window softmax's ring step as one Triton launch (``ops/window/step_triton.py``) on the CPU: through
Triton's interpreter against the PyTorch ring step (``triton_interpret_window_step.py``), on bf16/fp16/fp32 rings
and on float8 ones (``ops/window/float8.py``), and the dispatch rules of ``window_softmax_step_ring`` and
``float8_window_step_ring``. Its CUDA twin is in ``tests/gpu/test_gpu_window_step.py``."""

import torch

from helpers import run_triton_interpreter_script
from linearize import ops
from linearize.ops import window as W


def test_window_step_kernel_equals_the_torch_step_through_the_interpreter():
    """Token after token from a partly empty ring (padding holes) and a full one that wraps around: the
    outputs, the ring's keys and values, the valid slots and the slot counter; GQA (6 query heads on 2 key
    heads) and as many query as key heads, soft-capping on and off, fp32 rings."""
    run_triton_interpreter_script("triton_interpret_window_step.py", "gqa", "softcap", "mha", "rope")


def test_window_step_kernel_in_half_precision_parts_strides_and_the_decoder_through_the_interpreter():
    """bf16 rings under fp32 and bf16 queries, an fp16 ring under bf16 ones; the ring in parts merged by
    the part that arrives last (parts without a live slot too), the arrival counts left zero; q/k/v as strided slices of one projection; the
    products as broadcast sums instead of ``tl.dot`` tiles (bf16 and float8 rings); the fast decoder of tiny students with kept window
    layers on the kernel (each window step's output and the greedy tokens)."""
    run_triton_interpreter_script("triton_interpret_window_step.py", "half", "parts", "strided", "fma", "decoder")


def test_float8_ring_step_kernel_equals_the_torch_path_through_the_interpreter():
    """``float8_window_step_ring`` on the kernel (which quantises the new token and writes its codes) against
    its PyTorch path on the read-back ring, token after token from a partly empty ring and a full one that
    wraps around: the outputs (fp32 and bf16 queries, soft-capping on and off, GQA and as many query as key
    heads), the ring's codes, scales, valid slots and slot counter bit for bit; the kernel's e4m3 decoding of
    every byte but the NaNs."""
    run_triton_interpreter_script("triton_interpret_window_step.py", "float8", "float8_softcap", "float8_decode")


def test_float8_ring_step_kernel_rotates_quantises_and_encodes_as_torch_through_the_interpreter():
    """The float8 kernel rotating q and k itself (full and partial rotary, the ring whole and in parts) against
    RoPE in PyTorch then the PyTorch path, every ring buffer bit for bit; its quantisation of a vector against
    ``float8.quantize``; its e4m3 encoding against ``Tensor.to(float8_e4m3fn)`` on every e4m3 value, the ties
    between neighbours, subnormals, zeros of both signs and random numbers; in bf16, RoPE rounded once as the
    kernel rounds it (the casts rounded as on CUDA)."""
    run_triton_interpreter_script("triton_interpret_window_step.py", "float8_rope", "float8_rope_bf16",
                                  "float8_quantize", "float8_encode")


def test_float8_ring_step_kernel_in_parts_and_the_decoder_through_the_interpreter():
    """The float8 ring in 2 and 3 parts merged by the part that arrives last; the fast decoder of tiny students with float8
    window layers on the kernel (each window step's output and the greedy tokens)."""
    run_triton_interpreter_script("triton_interpret_window_step.py", "float8_parts", "float8_decoder")


def test_rings_with_sinks_on_the_kernel_through_the_interpreter():
    """Rings with attention sinks: the kernel whole and in parts (the slot advanced past the sinks), settled after
    each step, against the PyTorch step; the fast decoder of students whose window layers have sinks (fp32 and
    float8 rings, a prompt lacking sinks); past a small reach, the sinks' queries given or rotated in the kernel."""
    run_triton_interpreter_script("triton_interpret_window_step.py", "sinks", "sinks_decoder", "sinks_rope")


def _ring(b=2, hk=2, w=8, d=4, dtype=torch.float32):
    z = torch.zeros(b, hk, w, d, dtype=dtype)
    return ops.RingHybridState(z, z[..., :0], z.clone(), torch.zeros(b, hk, 1, 1, d + 1),
                               torch.zeros(b, w, dtype=torch.bool), slot=torch.zeros((), dtype=torch.long))


def test_window_step_dispatch_rule(monkeypatch):
    """The CPU takes the PyTorch step (the kernel is never called); on CUDA (a CPU tensor claiming CUDA for
    the rule) the kernel takes q and rings in bf16, fp16 and fp32 with contiguous buffers, where Triton is
    installed and ``WINDOW_STEP_KERNEL`` is on."""
    from linearize.ops.availability import triton_available

    q = torch.randn(2, 4, 1, 4)
    ring = _ring()
    assert not W._use_window_step_kernel(q, ring)
    if triton_available():
        from linearize.ops.window import step_triton

        def refuse(*args, **kwargs):
            raise AssertionError("the CPU step took the kernel")

        monkeypatch.setattr(step_triton, "window_step_ring_triton", refuse)
    o, ring = W.window_softmax_step_ring(q, torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4), ring, scale=0.5)
    assert o.shape == (2, 4, 1, 4) and int(ring.slot) == 1 and bool(ring.valid[:, 0].all())

    cuda_like = lambda dtype: type("CudaLike", (), {"is_cuda": True, "dtype": dtype})()  # noqa: E731
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert W._use_window_step_kernel(cuda_like(dtype), _ring(dtype=dtype)) == triton_available()
        assert W._use_window_step_kernel(cuda_like(torch.bfloat16), _ring(dtype=dtype)) == triton_available()
    assert not W._use_window_step_kernel(cuda_like(torch.float64), _ring())
    assert not W._use_window_step_kernel(cuda_like(torch.bfloat16), _ring(dtype=torch.float64))
    if hasattr(torch, "float8_e4m3fn"):  # float8 rings stay on the PyTorch step
        assert not W._use_window_step_kernel(cuda_like(torch.bfloat16), _ring(dtype=torch.float8_e4m3fn))
    strided = _ring()
    strided.keys = strided.keys.transpose(2, 3).contiguous().transpose(2, 3)
    assert not W._use_window_step_kernel(cuda_like(torch.float32), strided)
    monkeypatch.setattr(W, "WINDOW_STEP_KERNEL", False)
    assert not W._use_window_step_kernel(cuda_like(torch.float32), _ring())


def _float8_ring(b=2, hk=2, w=8, d=4):
    from linearize.ops.window.float8 import FLOAT8, Float8RingState

    z = torch.zeros(b, hk, w, d, dtype=FLOAT8)
    scale = torch.zeros(b, hk, w, 1)
    return Float8RingState(z, torch.zeros(b, hk, w, 0), z.clone(), torch.zeros(b, hk, 1, 1, d + 1),
                           torch.zeros(b, w, dtype=torch.bool), slot=torch.zeros((), dtype=torch.long),
                           key_scale=scale, value_scale=scale.clone())


def test_float8_step_dispatch_rule(monkeypatch):
    """A float8 ring's step: the CPU takes the PyTorch path on the read-back ring (the kernel is never called);
    on CUDA (a CPU tensor claiming CUDA for the rule) the kernel takes q in bf16, fp16 and fp32 with the ring's
    buffers contiguous, where Triton is installed and ``FLOAT8_STEP_KERNEL`` is on."""
    from linearize.ops.availability import triton_available
    from linearize.ops.window import float8 as f8

    q = torch.randn(2, 4, 1, 4)
    ring = _float8_ring()
    assert not f8._use_float8_step_kernel(q, ring)
    if triton_available():
        from linearize.ops.window import step_triton

        def refuse(*args, **kwargs):
            raise AssertionError("the CPU step took the kernel")

        monkeypatch.setattr(step_triton, "window_step_ring_float8_triton", refuse)
    o, ring = f8.float8_window_step_ring(q, torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4), ring,
                                         W.window_softmax_step_ring, scale=0.5)
    assert o.shape == (2, 4, 1, 4) and int(ring.slot) == 1 and bool(ring.valid[:, 0].all())
    assert bool((ring.key_scale[:, :, 0] > 0).all()) and ring.keys.dtype == f8.FLOAT8

    cuda_like = lambda dtype: type("CudaLike", (), {"is_cuda": True, "dtype": dtype})()  # noqa: E731
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert f8._use_float8_step_kernel(cuda_like(dtype), _float8_ring()) == triton_available()
    assert not f8._use_float8_step_kernel(cuda_like(torch.float64), _float8_ring())
    strided = _float8_ring()
    strided.key_scale = torch.zeros(2, 2, 8, 2)[..., :1]  # a slot's scale 2 floats apart
    assert not f8._use_float8_step_kernel(cuda_like(torch.bfloat16), strided)
    monkeypatch.setattr(f8, "FLOAT8_STEP_KERNEL", False)
    assert not f8._use_float8_step_kernel(cuda_like(torch.bfloat16), _float8_ring())


def test_ring_step_tiles_by_crowding(monkeypatch):
    """The ring step's (tensor cores, block, warps): a float8 ring whose step has half a program or more per
    aimed-for one (batch 88 to 256 on 3 key heads against 528) takes the crowded tiles, a split one (batch 64) or a bf16 ring the
    defaults; heads over 128 wide halve the block; ``STEP_CROWDED_FP8 = None`` keeps the defaults everywhere."""
    from linearize.ops.window import step_triton as st

    monkeypatch.setattr(st, "STEP_MMA", True)
    monkeypatch.setattr(st, "STEP_BLOCK", 128)
    monkeypatch.setattr(st, "STEP_WARPS", 4)
    monkeypatch.setattr(st, "STEP_CROWDED_FP8", (False, 64, 2))
    assert st.step_tiles(256, 3, 64, True, 528) == (False, 64, 2)
    assert st.step_tiles(88, 3, 64, True, 528) == (False, 64, 2)  # exactly half a program per aimed-for one
    assert st.step_tiles(87, 3, 64, True, 528) == (True, 128, 4)
    assert st.step_tiles(64, 8, 128, True, 528) == (False, 64, 2)  # Llama-3-8B's batch 64
    monkeypatch.setattr(st, "STEP_CROWDED_SHARE", 1.0)
    assert st.step_tiles(176, 3, 64, True, 528) == (False, 64, 2) and st.step_tiles(175, 3, 64, True, 528)[1] == 128
    monkeypatch.setattr(st, "STEP_CROWDED_SHARE", 0.5)
    assert st.step_tiles(64, 3, 64, True, 528) == (True, 128, 4)
    assert st.step_tiles(256, 3, 64, False, 528) == (True, 128, 4)
    assert st.step_tiles(256, 3, 256, True, 528) == (False, 32, 2)
    assert st.step_tiles(1, 3, 256, False, 528) == (True, 64, 4)
    assert st.ring_parts(256, 3, 4164, 64, 528) == 1 and st.ring_parts(64, 3, 4164, 128, 528) == 2
    monkeypatch.setattr(st, "STEP_MIN_PARTS", 3)  # a crowded batch's rings in parts too, never past their blocks
    assert st.ring_parts(256, 3, 4164, 64, 528) == 3 and st.ring_parts(64, 3, 4164, 128, 528) == 3
    assert st.ring_parts(256, 3, 100, 64, 528) == 2 and st.ring_parts(1, 3, 4164, 128, 528) == 33
    monkeypatch.setattr(st, "STEP_MAX_PARTS", 16)  # at most 16, however few programs the batch gives
    assert st.ring_parts(1, 3, 4164, 128, 528) == 16 and st.ring_parts(1, 3, 1284, 128, 528) == 11
    monkeypatch.setattr(st, "STEP_MAX_PARTS", None)
    monkeypatch.setattr(st, "STEP_CROWDED_FP8", None)
    assert st.step_tiles(256, 3, 64, True, 528) == (True, 128, 4)


def test_crowded_float8_ring_step_through_the_interpreter():
    """A crowded float8 ring's own tiles (``STEP_CROWDED_FP8``; one program aimed for, so every step is crowded):
    broadcast sums over blocks of 16 and tensor-core tiles of 32 with 2 warps, against the PyTorch path (fp32 and
    bf16 queries, soft-capping; the ring's buffers bit for bit), and the fast decoder of a float8 student with
    sinks past their reach."""
    run_triton_interpreter_script("triton_interpret_window_step.py", "float8_crowded")