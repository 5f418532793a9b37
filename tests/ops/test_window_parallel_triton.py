"""The window softmax over a whole sequence as one Triton launch (``ops/window/parallel_triton.py``) on the CPU:
through Triton's interpreter against the definition in float64 (``triton_interpret_window_parallel.py``), and
the dispatch of ``window_softmax`` to it. Its CUDA twin is in ``tests/gpu/test_gpu_window.py``."""

import torch

from helpers import run_triton_interpreter_script
from linearize.ops import window as W


def test_window_kernel_equals_the_definition_through_the_interpreter():
    """Grouped and plain heads, windows from 1 to past the sequence across tile edges, query tiles of one to four
    key blocks, soft-capping, left
    padding, strided q/k/v, bf16 and fp16 inputs, q rotated inside the kernel, attention sinks, the sinks' queries past
    the reach rotated inside it too."""
    run_triton_interpreter_script("triton_interpret_window_parallel.py", "gqa", "tiles", "mha", "softcap", "padding", "strided",
                                  "half", "rope", "sinks", "sink_rope")


def test_window_softmax_dispatches_to_the_kernel_without_a_gradient_through_the_interpreter():
    """``window_softmax`` (and the delta hybrid's window through it) takes the kernel without a gradient, the
    blocked form with one, and both give the same outputs."""
    run_triton_interpreter_script("triton_interpret_window_parallel.py", "dispatch")


def test_window_layers_prefill_through_the_kernel_through_the_interpreter():
    """Tiny students with kept window layers (Llama, Gemma 2 soft-capped, float8 windows) prefill a left-padded
    batch through the kernel with q rotated inside it: the logits of the PyTorch forms, and the fast decoder's
    greedy tokens from the states the prefill left."""
    run_triton_interpreter_script("triton_interpret_window_parallel.py", "model")


def test_the_kernel_is_not_taken_on_the_cpu_or_with_a_gradient():
    """Outside the interpreter only CUDA tensors go to the kernel; a wanted gradient never does."""
    from linearize.ops.window import parallel_triton

    q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    assert not parallel_triton.supported(q, k, v, 4)
    assert not W._use_window_triton(q.requires_grad_(), k, v, 4)
