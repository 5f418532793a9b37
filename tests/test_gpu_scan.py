"""The fused Triton selective scan against the PyTorch scan on CUDA (skipped elsewhere)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_triton_scan_equals_torch_scan_on_cuda(dtype, tol):
    from linearize.ops.selective_scan import selective_scan_chunked
    from linearize.ops.selective_scan_triton import selective_scan_triton

    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(0)
    b, t, dn, n = 2, 300, 1152, 16  # StripedMamba's width for SmolLM2 (expand 2 x 576)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    ins = [r(b, t, dn), torch.nn.functional.softplus(r(b, t, dn)) * 0.1, -torch.exp(r(dn, n)), r(b, t, n),
           r(b, t, n), r(dn), r(b, dn, n) * 0.1]
    w = r(b, t, dn)
    out = {}
    for name, fn in (("torch", lambda *a, **k: selective_scan_chunked(*a, **k, chunk_size=64)),
                     ("triton", selective_scan_triton)):
        xs = [x.double() if name == "torch" else x.to(dtype) for x in ins]
        xs = [x.detach().requires_grad_(True) for x in xs]
        y, h = fn(*xs[:6], initial_state=xs[6], output_final_state=True)
        grads = torch.autograd.grad((y.double() * w).sum() + h.double().sum(), xs)
        out[name] = [y, h, *grads]
    for a, e in zip(out["triton"], out["torch"]):
        assert ((a.double() - e).norm() / e.norm()).item() < tol
