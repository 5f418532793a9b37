"""The window softmax's ring step as one Triton launch (``ops/window/step_triton.py``) on the CPU: through
Triton's interpreter against the PyTorch ring step (``triton_interpret_window_step.py``), and the dispatch rule
of ``window_softmax_step_ring``. Its CUDA twin is in ``tests/gpu/test_gpu_window_step.py``."""

import torch

from helpers import run_triton_interpreter_script
from linearize import ops
from linearize.ops import window as W


def test_window_step_kernel_equals_the_torch_step_through_the_interpreter():
    """Token after token from a partly empty ring (padding holes) and a full one that wraps around: the
    outputs, the ring's keys and values, the valid slots and the slot counter; GQA (6 query heads on 2 key
    heads) and as many query as key heads, soft-capping on and off, fp32 rings."""
    run_triton_interpreter_script("triton_interpret_window_step.py", "gqa", "softcap", "mha")


def test_window_step_kernel_in_half_precision_parts_strides_and_the_decoder_through_the_interpreter():
    """bf16 rings under fp32 and bf16 queries, an fp16 ring under bf16 ones; the ring in parts merged by
    the second launch (parts without a live slot too); q/k/v as strided slices of one projection; the
    products as broadcast sums instead of ``tl.dot`` tiles; the fast decoder of tiny students with kept window
    layers on the kernel (each window step's output and the greedy tokens)."""
    run_triton_interpreter_script("triton_interpret_window_step.py", "half", "parts", "strided", "fma", "decoder")


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
