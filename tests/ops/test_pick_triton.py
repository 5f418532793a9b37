"""A greedy decode step's bookkeeping as one Triton launch (``ops/pick_triton.py``) on the CPU: through Triton's
interpreter against the PyTorch lines it stands for and in the fast decoder (``triton_interpret_pick.py``); when
the decoder takes it. Its CUDA twin is in ``tests/gpu/test_gpu_pick.py``."""

import torch

from helpers import run_triton_interpreter_script


def test_greedy_step_kernel_equals_the_torch_lines_and_decodes_the_same_tokens_through_the_interpreter():
    """Argmax ties within and across programs (the first wins), NaN, signed zeros, rows all -inf, bf16 and fp32,
    EOS ids with finished sequences and a pad that is an EOS, steps in a row (the buffers back as they were);
    then tiny students decoding greedily with the kernel, every step through it, the same tokens."""
    run_triton_interpreter_script("triton_interpret_pick.py", "pick", "decoder")


def test_the_greedy_step_takes_the_kernel_only_where_asked_and_able(monkeypatch):
    """On by default, only for CUDA tensors (or under the interpreter) with Triton installed, and only greedy."""
    from linearize.decode import loop
    from linearize.ops.availability import triton_available

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert loop.PICK_KERNEL
    monkeypatch.setattr(loop, "PICK_KERNEL", False)
    assert not loop._pick_kernel(torch.device("cuda"))
    monkeypatch.setattr(loop, "PICK_KERNEL", True)
    assert not loop._pick_kernel(torch.device("cpu"))
    assert loop._pick_kernel(torch.device("cuda")) == triton_available()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert loop._pick_kernel(torch.device("cpu")) == triton_available()
