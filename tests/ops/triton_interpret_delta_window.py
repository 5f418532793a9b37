"""Run by tests/mixers/test_delta.py in a subprocess, on the CPU through Triton's interpreter: the delta
hybrid's window softmax through the LoLCATs hybrid's kernels with zero features (``window_softmax_kernel``,
``WINDOW_KERNEL``) against the float64 window softmax (values and the gradients of q, k, v), and the whole
delta hybrid's sequence form with it against ``delta_window_naive``."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers.py
os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import triton_interpret_patch  # noqa: E402,F401  (NumPy >= 2.4 and Triton 3.6's interpreter)
from linearize import ops  # noqa: E402
from linearize.ops import window as WS  # noqa: E402
from linearize.ops.delta import window as W  # noqa: E402
from interpret_checks import _close, _masks as _mask  # noqa: E402

def check_window(b, h, hk, t, d, window, softcap, pad, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v = r(b, h, t, d), r(b, hk, t, d), r(b, hk, t, d)
    key_mask = _mask(b, t, pad)
    kw = dict(window=window, scale=d ** -0.5, softcap=softcap, key_mask=key_mask)
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    ones = torch.ones(h, dtype=torch.float64)
    want = ops.hybrid_attention_naive(ref[0], ref[1], *WS.zero_features(ref[0], ref[1]), ref[2], ones, **kw)
    mine = [x.float().requires_grad_() for x in (q, k, v)]
    got = WS.window_softmax_kernel(*mine, **kw)
    assert got.shape == want.shape and got.dtype == torch.float32
    real = key_mask[:, None, :, None] if key_mask is not None else 1.0  # padding queries: the hybrid zeroes them
    _close(got * real, want * real, "y")
    w = torch.randn(want.shape, generator=g, dtype=torch.float64) * real
    for name, a, e in zip("qkv", torch.autograd.grad((got.double() * w).sum(), mine),
                          torch.autograd.grad((want * w).sum(), ref)):
        _close(a, e, "d" + name)


def check_hybrid(b, h, hk, t, d, window, pad, seed):
    """``delta_window_chunked`` with its window through the kernels equals the token-by-token reference."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v = r(b, h, t, d), r(b, hk, t, d), r(b, hk, t, d)
    qd, kd = F.normalize(r(b, h, t, d), dim=-1), F.normalize(r(b, hk, t, d), dim=-1)
    gg, beta, lam = -torch.rand(b, hk, t, generator=g, dtype=torch.float64), torch.rand(
        b, hk, t, generator=g, dtype=torch.float64), torch.rand(b, h, t, generator=g, dtype=torch.float64)
    key_mask = _mask(b, t, pad)
    kw = dict(window=window, scale=d ** -0.5, key_mask=key_mask)
    want = W.delta_window_naive(q, k, qd, kd, v, gg, beta, lam, **kw)
    saved = WS._use_window_kernel
    WS._use_window_kernel = lambda q, k, v, window: True
    try:
        got, _ = W.delta_window_chunked(*(x.float() for x in (q, k, qd, kd, v, gg, beta, lam)), **kw, chunk_size=8)
    finally:
        WS._use_window_kernel = saved
    _close(got, want, "delta hybrid")


CASES = {
    "gqa": lambda: check_window(1, 4, 2, 9, 8, 4, None, 0, 0),  # GQA, T off the window's chunks
    "padding": lambda: check_window(2, 2, 1, 11, 8, 4, 2.0, 7, 1),  # left padding beyond a chunk, soft-capping
    "short": lambda: check_window(2, 3, 1, 3, 8, 8, None, 1, 2),  # T < window
    "wide": lambda: check_window(1, 2, 1, 40, 16, 16, None, 0, 3),  # several whole chunks
    "hybrid": lambda: check_hybrid(2, 4, 2, 21, 8, 4, 5, 4),  # the delta hybrid around it, GQA and padding
}

if __name__ == "__main__":
    for name in sys.argv[1:] or CASES:
        CASES[name]()
    print("ok")
