"""Run by test_xatl_ops.py in a subprocess: the fused Triton selective scan (forward and backward)
against the PyTorch chunked form, on the CPU through Triton's interpreter."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined

import torch  # noqa: E402

import triton_interpret_patch  # noqa: E402,F401  (NumPy >= 2.4 and Triton 3.6's interpreter)
from linearize.ops.selective_scan import selective_scan_chunked  # noqa: E402
from linearize.ops.selective_scan_triton import CHUNK, BLOCK_D, selective_scan_triton  # noqa: E402


def check(b, t, dn, n, with_d, with_state, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    ins = [r(b, t, dn), torch.nn.functional.softplus(r(b, t, dn)) * 0.5, -torch.exp(r(dn, n)), r(b, t, n), r(b, t, n),
           r(dn) if with_d else None, r(b, dn, n) if with_state else None]
    w_y, w_h = r(b, t, dn), r(b, dn, n)

    def run(fn, xs):
        live = [x for x in xs if x is not None]
        y, h = fn(*xs[:6], initial_state=xs[6], output_final_state=True)
        grads = torch.autograd.grad((y.double() * w_y).sum() + (h.double() * w_h).sum(), live)
        return [y, h, *grads]

    ref = run(lambda *a, **k: selective_scan_chunked(*a, **k, chunk_size=16),
              [x.requires_grad_(True) if x is not None else None for x in ins])
    got = run(selective_scan_triton, [x.detach().float().requires_grad_(True) if x is not None else None for x in ins])
    for name, a, e in zip(["y", "final state", "du", "ddt", "dA", "dB", "dC", "dD/dh0", "dh0"], got, ref):
        rel = ((a.double() - e).norm() / e.norm()).item()
        assert rel < 1e-5, (name, rel, (b, t, dn, n, with_d, with_state))


# lengths on and off the checkpoint chunk, channels on and off the channel block, N not a power of 2
check(2, CHUNK + 13, BLOCK_D + 8, 5, True, True, 0)
check(1, 2 * CHUNK, BLOCK_D, 16, False, False, 1)
check(3, 7, 9, 3, True, False, 2)
print("ok")
