"""Run by test_ops.py in a subprocess: the fused Triton linear-attention decode step against the
PyTorch step, token after token, on the CPU through Triton's interpreter."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined

import torch  # noqa: E402

import triton_interpret_patch  # noqa: E402,F401  (NumPy >= 2.4 and Triton 3.6's interpreter)
from linearize import ops  # noqa: E402
from linearize.ops.linear_step_triton import linear_step_triton  # noqa: E402


def check(b, h, hk, f, d, decay, normalize, n, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    log_decay = torch.log1p(-(2.0 ** (-5.0 - torch.arange(h, dtype=torch.float32)))) if decay else None
    q, k, v = r(b, h, n, f).exp() * 0.3, r(b, hk, n, f).exp() * 0.3, r(b, hk, n, d)
    _, ref = ops.linear_attention_chunked(q[:, :, :3], k[:, :, :3], v[:, :, :3], log_decay=log_decay,
                                          normalize=normalize, output_final_state=True)
    mine = ref.clone()
    for i in range(3, n):
        one = (q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1])
        want, ref = ops.linear_attention_step(*one, ref, log_decay=log_decay, normalize=normalize, backend="torch")
        got, mine = linear_step_triton(*one, mine, log_decay=log_decay, normalize=normalize)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (i, (got - want).abs().max())
    assert torch.allclose(mine, ref, atol=1e-5, rtol=1e-5)


for decay in (False, True):
    for normalize in (True, False):
        check(2, 6, 2, 12, 8, decay, normalize, 9, 0)  # GQA; F != D
        check(1, 3, 3, 5, 7, decay, normalize, 6, 1)  # odd sizes (masked tiles)
print("ok")
