"""Run by test_xatl_ops.py in a subprocess: the fused Triton selective scan (forward and backward)
against the PyTorch chunked form, on the CPU through Triton's interpreter."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined

import torch  # noqa: E402

import triton_interpret_patch  # noqa: E402,F401  (NumPy >= 2.4 and Triton 3.6's interpreter)
import linearize.ops.selective_scan_triton as sst  # noqa: E402
from linearize.ops.selective_scan import selective_scan_chunked  # noqa: E402

PRODUCTION_CHUNKING = (sst.CHUNK, sst.CKPT, sst.GROUP)


def check(b, t, dn, n, with_d, with_state, seed, softplus=False):
    """With ``softplus``, the kernels take dt before softplus (``delta_softplus``); the reference after it."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    dt = r(b, t, dn) - 1.0 if softplus else torch.nn.functional.softplus(r(b, t, dn)) * 0.5
    ins = [r(b, t, dn), dt, -torch.exp(r(dn, n)), r(b, t, n), r(b, t, n),
           r(dn) if with_d else None, r(b, dn, n) if with_state else None]
    w_y, w_h = r(b, t, dn), r(b, dn, n)

    def run(fn, xs):
        live = [x for x in xs if x is not None]
        y, h = fn(*xs[:6], initial_state=xs[6], output_final_state=True)
        grads = torch.autograd.grad((y.double() * w_y).sum() + (h.double() * w_h).sum(), live)
        return [y, h, *grads]

    def reference(u, dt, *rest, **kw):
        return selective_scan_chunked(u, torch.nn.functional.softplus(dt) if softplus else dt, *rest, **kw,
                                      chunk_size=16)

    ref = run(reference, [x.requires_grad_(True) if x is not None else None for x in ins])
    got = run(lambda *a, **k: sst.selective_scan_triton(*a, **k, delta_softplus=softplus),
              [x.detach().float().requires_grad_(True) if x is not None else None for x in ins])
    names = ["y", "final state", "du", "ddt", "dA", "dB", "dC"] + ["dD"] * with_d + ["dh0"] * with_state
    assert len(got) == len(ref) == len(names)
    for name, a, e in zip(names, got, ref):
        rel = ((a.double() - e).norm() / e.norm()).item()
        assert rel < 1e-5, (name, rel, (b, t, dn, n, with_d, with_state, softplus), (sst.CHUNK, sst.CKPT, sst.GROUP))


def final_state_unused(b, t, dn, n):
    """Only y is used: the final state gets no gradient (and the kernels must cope)."""
    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    ins = [r(b, t, dn), torch.nn.functional.softplus(r(b, t, dn)) * 0.5, -torch.exp(r(dn, n)), r(b, t, n), r(b, t, n)]
    w = r(b, t, dn)
    outs = []
    for fn, xs in ((lambda *a: selective_scan_chunked(*a, chunk_size=16), [x.clone().requires_grad_(True) for x in ins]),
                   (sst.selective_scan_triton, [x.float().requires_grad_(True) for x in ins])):
        y, _ = fn(*xs)
        outs.append(torch.autograd.grad((y.double() * w).sum(), xs))
    for a, e in zip(*outs):
        assert ((a.double() - e).norm() / e.norm()).item() < 1e-5


# tiny time chunks, so that short sequences span several of them (and several checkpoints each);
# N mostly not a power of 2
sst.CHUNK, sst.CKPT, sst.GROUP = 8, 4, 4
check(2, 2 * 8 + 5, sst.BLOCK_D + 8, 5, True, True, 0)  # T off the chunk and checkpoint; Dn off the block
check(1, 2 * 8, sst.BLOCK_D, 16, False, False, 1)  # T on the chunk
check(3, 7, 9, 3, True, False, 2)  # T shorter than one chunk
check(2, 1, 5, 4, False, True, 3)  # T = 1
check(1, 8 + 4, 6, 2, False, True, 4)  # T on a checkpoint, off the chunk
check(2, 2 * 8 + 3, sst.BLOCK_D + 3, 4, True, True, 10, softplus=True)  # dt's softplus inside the kernels
final_state_unused(2, 19, 7, 3)
sst.CHUNK, sst.CKPT, sst.GROUP = 32, 16, 4  # four register groups per checkpoint, three of them advanced to
check(1, 32 + 21, 9, 3, True, True, 5)
sst.CHUNK, sst.CKPT, sst.GROUP = 16, 16, 8  # two groups of 8 per checkpoint
check(1, 2 * 16 + 6, 7, 4, True, True, 8)
sst.CHUNK, sst.CKPT, sst.GROUP = PRODUCTION_CHUNKING  # the production chunking once (softplus and D, a state)
check(1, 128 + 13, 9, 3, True, True, 9, softplus=True)
print("ok")
