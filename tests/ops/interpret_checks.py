"""Checks shared by the Triton-interpreter scripts (``triton_interpret_*.py``): the relative error bound,
the left-padding mask their cases use, and fp32 -> bf16 casts rounded as on CUDA."""

import contextlib

import torch

TOL = 2e-5


def _close(got, want, what, floor=1e-6, tol=TOL):
    """Largest error relative to the largest reference entry (at least ``floor``)."""
    err = ((got.double() - want).abs().max() / want.abs().max().clamp_min(floor)).item()
    assert err < tol, (what, err)


def _masks(b, t, pad):
    """``[B, T]`` key mask with the last sequence left-padded by ``pad`` tokens (None for no padding)."""
    if not pad:
        return None
    key_mask = torch.ones(b, t, dtype=torch.bool)
    key_mask[-1, :pad] = False  # the last sequence left-padded
    return key_mask


def round_bf16_like_cuda():
    """From now on the interpreter's fp32 -> bf16 casts round to nearest even as CUDA's do (Triton's interpreter
    truncates them), so that a kernel's 16-bit results can be compared bit for bit with PyTorch's. Returns the
    function that undoes it."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    cast = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            data = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).bfloat16()
            return interpreter.TensorHandle(data.view(torch.int16).numpy().view(np.uint16), dst_type.scalar)
        return cast(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_impl
    return lambda: setattr(interpreter.InterpreterBuilder, "cast_impl", cast)


@contextlib.contextmanager
def bf16_rounded_like_cuda():
    """``round_bf16_like_cuda`` within the block only."""
    undo = round_bf16_like_cuda()
    try:
        yield
    finally:
        undo()
