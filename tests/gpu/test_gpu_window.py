"""CUDA checks of the window-softmax layers' fast forms (``ops/window``): the causal flash calls on blocks
(``flash.py``, prefill without a gradient) against SDPA on masked blocks, in bf16 at a kept layer's shapes."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("t,window", [(4096, 1280), (3000, 1280), (1024, 256), (700, 1280)])
def test_flash_blocks_equal_sdpa_blocks_on_cuda(t, window):
    from linearize.ops.window import flash, window_softmax, window_softmax_sdpa

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 9, t, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, 3, t, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    with torch.no_grad():
        want = window_softmax_sdpa(q.float(), k.float(), v.float(), window=window, scale=0.125)
        assert flash.supported(q, k, v, window) == (t > window)
        got = window_softmax(q, k, v, window=window, scale=0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
