"""The fused prelude of the LoLCATs hybrid's backward (``ops/hybrid/prelude_triton.py``: RoPE and
Hedgehog maps, forward and backward, as Triton kernels) on the CPU through Triton's interpreter
(``triton_interpret_hedgehog_rope.py``). The hybrid's interpreter tests (``test_hybrid_chunk_triton.py``)
and CUDA tests (``test_gpu_hybrid.py``) run it too, as ``FUSED_PRELUDE`` is on by default."""

import pytest

from helpers import run_triton_interpreter_script


def test_hedgehog_rope_kernels_equal_the_float64_reference_through_the_interpreter():
    """Rotated x, features, dx and dW against ``rope_half`` + ``hedgehog_features`` + autograd in
    float64: RoPE over every dim, part of them (cos/sin per sequence) or none, shared and per-head
    weights, strided x, lengths off the tile, without the rotated gradient, dW or dx alone, programs
    summing several tiles, fp16 products (over several of the 16-bit tiles); the features of x before RoPE
    (``nope``: full and partial RoPE, fp16, dW alone); and the hybrid's backward with the switch on equals off,
    also recomputed inside a checkpoint (--gradient-checkpointing: its saved tensors unpack once)."""
    run_triton_interpreter_script("triton_interpret_hedgehog_rope.py", "full", "partial", "norope", "nodrot",
                                  "weights", "dx_only", "steps", "half", "half_shared", "half_tiles", "nope",
                                  "nope_partial", "nope_half", "nope_weights", "switch", "switch_checkpointed")


@pytest.mark.slow
def test_hybrid_backward_with_fused_prelude_equals_the_pytorch_prelude_through_the_interpreter():
    """The hybrid's backward, ``FUSED_PRELUDE`` on against off: shared weights without RoPE, the
    weights' gradients alone (LoLCATs stage 1), fp16."""
    run_triton_interpreter_script("triton_interpret_hedgehog_rope.py", "switch_shared_norope", "switch_weights",
                                  "switch_half")
