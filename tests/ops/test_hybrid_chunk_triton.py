"""The LoLCATs hybrid's whole-sequence Triton kernels on the CPU: through Triton's interpreter against
the float64 references (``triton_interpret_hybrid_seq.py``), and the dispatch rule. Their CUDA twins
are in ``test_gpu_hybrid.py``."""

import pytest
import torch

from helpers import run_triton_interpreter_script
from linearize import ops


def test_hybrid_kernels_equal_the_float64_reference_through_the_interpreter():
    """Values, every gradient (q, k, v, features or Hedgehog weights, gamma) and the prefill's final
    state: GQA and MQA, lengths off the chunks, shorter than the window and of one token, windows of
    1 and of whole tiles, left padding longer than a chunk, soft-capping, fp16 products (bf16 the
    interpreter cannot multiply); RoPE (full, partial, none)
    and Hedgehog maps inside the kernels, shared or per head, and the maps' gradients alone."""
    run_triton_interpreter_script("triton_interpret_hybrid_seq.py", "gqa", "padding", "short", "one", "window1", "blocks",
                                  "prefill_blocks", "half", "exact", "hedgehog", "hedgehog_partial", "hedgehog_norope")


def test_sinks_on_the_forward_kernels_equal_the_float64_reference_through_the_interpreter():
    """``hybrid_triton_sinks`` (the first S tokens cached, ``sparse_priority: "first"``) against
    ``sparse_hybrid_attention_naive`` and the chunked form's state: GQA and MQA, left padding, soft-capping,
    both anchors, RoPE over all dims, half of them and none, S above one key tile (17), a prompt whose
    first tokens are still in the window (values only) and fewer real tokens than S."""
    run_triton_interpreter_script("triton_interpret_hybrid_seq.py", "sinks", "sinks_window", "sinks_partial",
                                  "sinks_unsettled")


def test_gated_hybrid_kernels_equal_the_float64_reference_through_the_interpreter():
    """With gates (``log_gate``, a fading linear state) against ``hybrid_attention_chunked`` with gates in
    float64: values, the prefill's final state and every gradient (the log gates' too, also alone): GQA
    and MQA, lengths off the chunks and shorter than the window, a window of one token, left padding
    longer than a chunk and a hole, soft-capping, fp16 products, whole tiles, query blocks of half a chunk,
    scans of several tiles (the decayed carry), gates of 1 (= the ungated kernels) and closed ones (log
    -60; also with fp16 products, the gates' gradient ~0), RoPE and Hedgehog maps in the kernels, the maps
    reading the rotated q/k or those before RoPE (``feature_rope`` off: gated or not, partial RoPE; both
    backward preludes); the sinks' kernels refuse gates; a tiny gated student with features before RoPE
    (the mixer's dispatch to the kernels' Hedgehog maps, the gates' parameters' gradients)."""
    run_triton_interpreter_script("triton_interpret_hybrid_gates.py", "gqa", "padding", "short", "window1", "exact",
                                  "half", "open", "closed", "closed_half", "scan_tiles", "blocks", "hedgehog",
                                  "hedgehog_torch_prelude", "nope", "nope_partial", "nope_torch_prelude",
                                  "sinks_refused", "model_gated")


@pytest.mark.slow
def test_lolcats_learned_decay_on_the_kernels_equals_the_torch_form_through_the_interpreter():
    """A learned decay (constant gates per key head) with Hedgehog maps and RoPE inside the kernels."""
    run_triton_interpreter_script("triton_interpret_hybrid_gates.py", "model_learned")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["model_llama", "model_gemma2", "model_t2r", "model_sinks", "model_sinks_window"])
def test_lolcats_mixers_on_the_kernels_equal_the_torch_form_through_the_interpreter(case):
    """A tiny converted model with its mixers dispatching to the kernels (as on CUDA) against the
    PyTorch form: logits, every parameter's gradient, the prefill's cache; left padding. Llama (GQA,
    RoPE fused), Gemma 2 (soft-capping), T2R maps (features computed in PyTorch); attention sinks under
    both anchors (no gradient: logits, the settled prefill's cache, the next token's logits)."""
    run_triton_interpreter_script("triton_interpret_hybrid_seq.py", case)


def test_hybrid_dispatch_rule():
    q = torch.zeros(1, 2, 3, 4)
    kw = dict(window=64, head_dim=64, feature_width=64)
    assert not ops.use_hybrid_kernel(q, "auto", **kw)  # the CPU takes the PyTorch form
    assert not ops.use_hybrid_kernel(q, "torch", **kw)
    with pytest.raises(RuntimeError, match="backend='fla'"):
        ops.use_hybrid_kernel(q, "fla", **kw)
    assert ops.hybrid_attention_kernel_dtype(q.bfloat16(), q) == torch.float32
    # on CUDA: bf16/fp16 under "auto", fp32 only under "fla" (a CPU tensor claiming CUDA for the rule)
    cuda_like = type("CudaLike", (), {"is_cuda": True, "dtype": torch.bfloat16})()
    assert ops.use_hybrid_kernel(cuda_like, "auto", **kw) == ops.fla_backend.triton_available()
    assert not ops.use_hybrid_kernel(cuda_like, "auto", **kw, dtype=torch.float32)
    assert ops.use_hybrid_kernel(cuda_like, "fla", **kw, dtype=torch.float32)
    assert not ops.use_hybrid_kernel(cuda_like, "auto", **{**kw, "window": 256})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ops.hybrid_attention_kernel_dtype(q.bfloat16(), q) == torch.bfloat16  # fp32 RoPE output under autocast
    # on the CPU the entry point is the chunked form
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(1, 2, 9, 4, generator=g), torch.randn(1, 1, 9, 4, generator=g),
          torch.rand(1, 2, 9, 6, generator=g), torch.rand(1, 1, 9, 6, generator=g), torch.randn(1, 1, 9, 4, generator=g)]
    gamma = torch.full((2,), 0.3)
    a, sa = ops.hybrid_attention(*xs, gamma, window=4, scale=0.5, output_final_state=True)
    b, sb = ops.hybrid_attention_chunked(*xs, gamma, window=4, scale=0.5, output_final_state=True)
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(sa.tensors(), sb.tensors()))


@pytest.mark.parametrize("form", ["naive", "chunked"])
def test_hybrid_gradient_is_finite_at_padding_queries(form):
    """A padding query has no term (its output is 0); a large gradient reaching it (the last padding
    token predicts the first real one) once overflowed ``dy / tiny`` to inf and met the masks' zeros
    as NaN (seen in a tiny Gemma 2 with left padding)."""
    g = torch.Generator().manual_seed(0)
    b, h, hk, t, d, f = 2, 4, 2, 9, 4, 6
    xs = [torch.randn(b, h, t, d, generator=g), torch.randn(b, hk, t, d, generator=g),
          torch.rand(b, h, t, f, generator=g), torch.rand(b, hk, t, f, generator=g), torch.randn(b, hk, t, d, generator=g)]
    xs = [x.requires_grad_() for x in xs]
    gamma = torch.full((h,), 0.3, requires_grad=True)
    key_mask = torch.ones(b, t, dtype=torch.bool)
    key_mask[1, :4] = False
    fn = getattr(ops, f"hybrid_attention_{form}")
    out = fn(*xs, gamma, window=3, scale=0.5, key_mask=key_mask)
    y = out[0] if isinstance(out, tuple) else out
    assert torch.equal(y[1, :, :4], torch.zeros_like(y[1, :, :4]))
    (y * 100.0).sum().backward()  # 100 per output entry reaches the padding queries too
    for x in (*xs, gamma):
        assert torch.isfinite(x.grad).all()
    # the padding's keys, features and values get no gradient
    for x in xs[1:]:
        assert torch.equal(x.grad[1, :, :4], torch.zeros_like(x.grad[1, :, :4]))


def test_kernel_tiles_follow_the_input_width():
    """16-bit inputs take the swept tiles (the modules' constants); 32- and 64-bit ones the wider
    registers' tiles in ``WIDE``, the hybrid's and the prelude's alike; a sweep's setting is read
    at the call."""
    pytest.importorskip("triton")
    from linearize.ops.hybrid import chunk_triton as kernels
    from linearize.ops.hybrid import prelude_triton as prelude

    for module in (kernels, prelude):
        for dtype in (torch.bfloat16, torch.float16):
            assert module._knobs(dtype) == {name: getattr(module, name) for name in module._knobs(dtype)}
        for dtype in (torch.float32, torch.float64):
            wide = module._knobs(dtype)
            assert wide.keys() == module._knobs(torch.bfloat16).keys() and all(wide[k] == v for k, v in module.WIDE.items())
    saved = kernels.FWD_WARPS
    kernels.FWD_WARPS = 2
    try:
        assert kernels._knobs(torch.bfloat16)["FWD_WARPS"] == 2 and kernels._knobs(torch.float32)["FWD_WARPS"] == kernels.WIDE["FWD_WARPS"]
    finally:
        kernels.FWD_WARPS = saved


def test_sink_plan_places_the_first_real_tokens_once_per_mask():
    """``sink_plan``: each position's cache slot and each slot's position for the first S real tokens
    (left padding, a hole, fewer real tokens than S), whether they have all left the window; a later
    layer's equal mask takes the same plan, a changed one (even the same tensor changed in place) a new one."""
    from linearize.ops.hybrid.chunk_triton import sink_plan

    mask = torch.tensor([[0, 0, 1, 1, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0, 1, 1]],
                        dtype=torch.bool)
    plan = sink_plan(mask, 3, 10, 4, 3, "cpu")
    assert plan.slot.tolist() == [[-1, -1, 0, 1, -1, 2, -1, -1, -1, -1], [0, 1, 2, -1, -1, -1, -1, -1, -1, -1],
                                  [-1] * 8 + [0, 1]]
    assert plan.pos.tolist() == [[2, 3, 5], [0, 1, 2], [8, 9, 10]]  # 10: an empty slot
    assert plan.has.tolist() == [[True] * 3, [True] * 3, [True, True, False]] and plan.first.tolist() == [2, 0, 8]
    assert not plan.settled  # the last sequence has two real tokens
    assert sink_plan(mask.clone(), 3, 10, 4, 3, "cpu") is plan  # the next layer's mask, equal
    assert sink_plan(mask, 3, 10, 4, 2, "cpu") is not plan  # another cache size
    two = mask[:2].clone()
    p2 = sink_plan(two, 2, 10, 4, 3, "cpu")
    assert p2.settled  # the 3rd real token at 5 and 2, both <= 10 - 1 - 4
    two[0, 5] = False  # changed in place: the 3rd real token moves to 6 (still settled), the plan with it
    p3 = sink_plan(two, 2, 10, 4, 3, "cpu")
    assert p3 is not p2 and p3.pos[0].tolist() == [2, 3, 6]
    assert sink_plan(None, 2, 7, 4, 3, "cpu").settled and not sink_plan(None, 2, 6, 4, 3, "cpu").settled
