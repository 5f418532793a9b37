"""Run by test_xatl_ops.py in a subprocess: the fused Triton per-head GroupNorm + affine + swish gate
(forward and backward) against the formula in float64, on the CPU through Triton's interpreter."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import triton_interpret_patch  # noqa: E402,F401  (NumPy >= 2.4 and Triton 3.6's interpreter)
import linearize.ops.group_norm_gate_triton as gng  # noqa: E402


def reference(x, w, b, eps, gate):
    """The definition, on ``[..., H, D]``."""
    h, d = x.shape[-2:]
    mean = x.mean(-1, keepdim=True)
    y = (x - mean) / torch.sqrt(((x - mean) ** 2).mean(-1, keepdim=True) + eps)
    if w is not None:
        y = y * w.view(h, d) + b.view(h, d)
    return y if gate is None else y * F.silu(gate)


def check(b, t, h, d, affine, gated, seed, eps=1e-5):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    # x as the mixers pass it: the [B, T, H, D] transpose of [B, H, T, D] (here not contiguous);
    # the gate a column slice of a wider [B, T, *] projection, as RetNet's
    x = r(b, h, t, d).mul(3).add(1).transpose(1, 2)
    gate = r(b, t, (h + 2) * d)[..., d : d * (h + 1)].view(b, t, h, d) if gated else None
    w, bias = (1 + r(h * d), r(h * d)) if affine else (None, None)
    w_y = r(b, t, h, d)
    ins = [x, w, bias, gate]
    names = ["dx", "dweight", "dbias", "dgate"]

    def run(fn, xs):
        xs = [v.requires_grad_(True) if v is not None else None for v in xs]
        y = fn(xs[0], xs[1], xs[2], eps, xs[3])
        live = [(n, v) for n, v in zip(names, xs) if v is not None]
        grads = torch.autograd.grad((y.double() * w_y).sum(), [v for _, v in live])
        return y, dict(zip([n for n, _ in live], grads))

    want, want_g = run(reference, [v.detach().clone() if v is not None else None for v in ins])
    got, got_g = run(gng.group_norm_gate_triton, [v.detach().float() if v is not None else None for v in ins])
    case = (b, t, h, d, affine, gated, gng.TILE)
    assert got.dtype == torch.float32 and got.shape == want.shape, case
    assert set(got_g) == set(want_g), case
    for name, a, e in [("y", got, want), *((n, got_g[n], want_g[n]) for n in want_g)]:
        assert a.dtype == torch.float32, (name, a.dtype, case)
        rel = ((a.double() - e).norm() / e.norm()).item()
        assert rel < 1e-5, (name, rel, case)


def dtypes():
    """bf16 gate and output, fp32 x and parameters: each gradient in its input's dtype."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 5, 2, 16, generator=g, requires_grad=True)
    w, b = torch.randn(32, generator=g, requires_grad=True), torch.randn(32, generator=g, requires_grad=True)
    gate = torch.randn(3, 5, 2, 16, generator=g).bfloat16().requires_grad_(True)
    y = gng.group_norm_gate_triton(x, w, b, 1e-6, gate, out_dtype=torch.bfloat16)
    want = reference(x.double(), w.double(), b.double(), 1e-6, gate.double())
    assert y.dtype == torch.bfloat16
    assert ((y.double() - want).norm() / want.norm()).item() < 1e-2
    grads = torch.autograd.grad(y.float().sum(), [x, w, b, gate])
    assert [v.dtype for v in grads] == [torch.float32] * 3 + [torch.bfloat16]


gng.TILE = 256  # small token blocks: several per head, the last one partial
check(2, 13, 3, 64, True, True, 0)  # D a power of 2: 4 tokens per block, 26 tokens
check(2, 13, 3, 48, True, True, 1)  # D not a power of 2 (masked columns)
check(1, 11, 2, 48, False, True, 2)  # no affine
check(3, 7, 3, 64, True, False, 3)  # no gate
check(1, 5, 4, 24, False, False, 4)  # neither
gng.TILE = 4096
check(2, 37, 3, 64, True, True, 5)  # the production block: 74 tokens, one full block and a partial one
dtypes()
print("ok")
