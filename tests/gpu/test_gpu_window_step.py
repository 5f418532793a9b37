"""The window softmax's ring step as one Triton launch (``ops/window/step_triton.py``) on CUDA against the PyTorch
ring step, at a kept layer's shapes (9 query heads on 3 key heads, head dim 64, a ring of 1,280 slots) and off
them: token after token, the outputs and the ring's every buffer; and replayed from a CUDA graph around the
ring. Skipped without CUDA."""

import pytest
import torch

from linearize import ops
from linearize.ops import window as W

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

D = 64


def _ring(b, hk, w, dtype, fill, g):
    """A ring with about ``fill`` of its slots valid (the others zero), the counter near its end."""
    valid = torch.rand(b, w, device="cuda", generator=g) < fill
    keys, values = (torch.randn(b, hk, w, D, device="cuda", generator=g).to(dtype) * valid[:, None, :, None]
                    for _ in range(2))
    return ops.RingHybridState(keys, keys[..., :0], values, torch.zeros(b, hk, 1, 1, D + 1, device="cuda"), valid,
                               slot=torch.tensor(w - 3, device="cuda"))


def _reference(q, k, v, ring, **kw):
    W.WINDOW_STEP_KERNEL = False
    try:
        return W.window_softmax_step_ring(q, k, v, ring, **kw)
    finally:
        W.WINDOW_STEP_KERNEL = True


def _qkv(b, h, hk, dtype, g):
    """Strided slices of one projection's output, as the adapters split it."""
    out = torch.randn(b, 1, (h + 2 * hk) * D, device="cuda", generator=g).to(dtype)
    return tuple(x.unflatten(-1, (-1, D)).transpose(1, 2) for x in out.split([h * D, hk * D, hk * D], -1))


@pytest.mark.parametrize("shape", [(1, 9, 3, 1280), (64, 9, 3, 1280), (3, 6, 2, 333), (2, 4, 4, 100)])
@pytest.mark.parametrize("ring_dtype,q_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                (torch.float16, torch.float16), (torch.float32, torch.float32)])
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("parts", [None, 1, 3])
def test_window_step_kernel_equals_the_torch_step_on_cuda(shape, ring_dtype, q_dtype, softcap, parts):
    from linearize.ops.window.step_triton import window_step_ring_triton

    b, h, hk, w = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    ring = _ring(b, hk, w, ring_dtype, 0.4, g)
    twin = ring.map(torch.clone)
    tol = 1e-4 if ring_dtype == torch.float32 else 2e-2
    with torch.no_grad():
        for i in range(6):  # wraps around after 3
            q, k, v = _qkv(b, h, hk, q_dtype, g)
            assert W._use_window_step_kernel(q, ring)
            want, twin = _reference(q, k, v, twin, scale=D ** -0.5, softcap=softcap)
            got, ring = window_step_ring_triton(q, k, v, ring, scale=D ** -0.5, softcap=softcap, parts=parts)
            assert got.dtype == q_dtype and got.shape == want.shape
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
            for a, c in ((ring.keys, twin.keys), (ring.values, twin.values), (ring.valid, twin.valid),
                         (ring.slot, twin.slot)):
                assert torch.equal(a, c), i


@pytest.mark.parametrize("programs", [None, 1])  # the ring in parts merged by a second launch; one part
def test_window_step_replays_from_a_cuda_graph(programs, monkeypatch):
    """One step captured (the dispatch takes the kernel) and replayed past the ring's end, against the PyTorch
    step run eagerly on a copy."""
    from linearize.ops.window import step_triton

    monkeypatch.setattr(step_triton, "STEP_PROGRAMS", programs)
    batch, h, hk, w = 2, 9, 3, 256
    g = torch.Generator(device="cuda").manual_seed(1)
    ring = _ring(batch, hk, w, torch.bfloat16, 0.5, g)
    twin = ring.map(torch.clone)
    q, k, v = (torch.zeros(batch, n, 1, D, device="cuda", dtype=torch.bfloat16) for n in (h, hk, hk))
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile the kernels first, on a scratch ring
            scratch = ring.map(torch.clone)
            for _ in range(2):
                W.window_softmax_step_ring(q, k, v, scratch, scale=0.125)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o, _ = W.window_softmax_step_ring(q, k, v, ring, scale=0.125)
        for i in range(w + 20):
            for x in (q, k, v):
                x.copy_(torch.randn(x.shape, device="cuda", generator=g))
            graph.replay()
            want, twin = _reference(q, k, v, twin, scale=0.125)
            torch.testing.assert_close(o.float(), want.float(), atol=2e-2, rtol=2e-2)
            assert torch.equal(ring.slot, twin.slot) and torch.equal(ring.valid, twin.valid), i
        assert torch.equal(ring.keys, twin.keys) and torch.equal(ring.values, twin.values)
