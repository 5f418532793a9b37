"""Tiny random models and a tiny tokenizer for fast tests."""

import torch


def tiny_config(family: str, **overrides):
    """A few-layer random model of each supported family, small enough for float64 CPU tests."""
    from transformers import AutoConfig

    common = dict(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=6, max_position_embeddings=256)
    per_family = {
        "llama": dict(num_key_value_heads=2, attention_bias=False),
        "qwen2": dict(num_key_value_heads=2),  # q/k/v biases
        "qwen3": dict(num_key_value_heads=3, head_dim=8),  # per-head q_norm / k_norm
        "mistral": dict(num_key_value_heads=1, sliding_window=None),  # multi-query
        "gemma2": dict(num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=12,
                       attn_logit_softcapping=20.0, final_logit_softcapping=None, sliding_window=4096),
        "gpt_neox": dict(rotary_pct=0.5, use_parallel_residual=True),
        "gemma": dict(num_key_value_heads=1, head_dim=8),
        "gemma3_text": dict(num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, sliding_window=64,
                            layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
        "smollm3": dict(num_key_value_heads=2, no_rope_layers=[1, 1, 0], pad_token_id=0, bos_token_id=1, eos_token_id=1),  # layer 2 has no RoPE
    }[family]
    cfg = AutoConfig.for_model(family, **{**common, **per_family, **overrides})
    cfg._attn_implementation = "eager" if family.startswith("gemma") else "sdpa"
    return cfg


def tiny_tokenizer():
    """Word-level tokenizer over 'w0' .. 'w96' matching the tiny models' vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(97)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w1", pad_token="w0")


def random_grads(out, inputs):
    """Gradients of a fixed random projection of ``out`` w.r.t. ``inputs`` (zeros where unused)."""
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    grads = torch.autograd.grad((out * w).sum(), inputs, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs)]


def decode_incrementally(model, ids, prefill: int):
    """Logits of ``ids`` from a prefill of ``prefill`` tokens and then one token at a time through the cache."""
    out = model(ids[:, :prefill], use_cache=True)
    steps = [out.logits]
    for t in range(prefill, ids.shape[1]):
        out = model(ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True)
        steps.append(out.logits)
    return torch.cat(steps, dim=1)


def greedy_by_full_forwards(model, prompt, n: int):
    """Greedy continuation by argmax of a full parallel forward per token (no cache): the reference for generate()."""
    seq = prompt
    for _ in range(n):
        nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    return seq


def assert_decodes_like_parallel(model, prefill: int = 13, new: int = 12):
    """A prefill then one token at a time gives the parallel forward's logits (float64: to 1e-10), and plain
    greedy ``generate()`` the tokens of one full forward per token."""
    ids = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(decode_incrementally(model, ids, prefill), model(ids, use_cache=False).logits,
                               atol=1e-10, rtol=0)
    prompt = ids[:1, :7]
    out = plain_generate(model, prompt, max_new_tokens=new, do_sample=False, pad_token_id=0)
    assert torch.equal(out, greedy_by_full_forwards(model, prompt, new))


def assert_fast_equals_generate(model, new: int = 16):
    """``linearize.fast`` gives plain ``generate()``'s greedy tokens on a batch with a left-padded prompt,
    prefilled together and one sequence at a time (the prefill's states then joined)."""
    from linearize.decode import FastDecoder, fast_generate

    ids = torch.randint(2, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    ref = plain_generate(model, ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
    assert torch.equal(fast_generate(model, ids, mask, max_new_tokens=new, pad_token_id=0), ref)
    assert torch.equal(FastDecoder(model, prefill_batch=1).generate(ids, mask, max_new_tokens=new, pad_token_id=0), ref)


def run_triton_interpreter_script(name: str, *args: str) -> None:
    """Run ``tests/ops/<name> [args]`` (a check of our Triton kernels through Triton's CPU interpreter) in
    a fresh process, which must print ``ok``; skipped where Triton is not installed."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    pytest.importorskip("triton")
    here = Path(__file__).parent
    done = subprocess.run([sys.executable, str(here / "ops" / name), *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(here.parent / "src")})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def run_two_processes(script, *args: str, timeout: int = 300) -> str:
    """Run ``script [args]`` under ``torch.distributed.run`` as 2 processes (gloo on the CPU); returns
    their stdout, failing with the end of stderr if either process fails."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script), *args], env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def tiny_student(tiny_model, family, spec, dtype=None):
    """A tiny ``family`` model converted with ``spec`` (float64 by default), decoding without EOS."""
    import linearize

    model = linearize.convert(tiny_model(family, dtype=dtype or torch.float64), spec)
    model.generation_config.eos_token_id = None
    return model


def loss_grads_and_prefill(model, ids, mask, labels):
    """One training forward and backward of ``model`` (its grads zeroed first), then a prefill into a fresh
    ``LinearizeCache``: ``(logits, {name: grad}, cache)``, what the kernel-against-PyTorch checks compare."""
    from linearize.cache import LinearizeCache

    model.zero_grad()
    out = model(ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    cache = LinearizeCache(model)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    return out.logits.detach(), grads, cache


def plain_generate(model, *args, **kwargs):
    """``model.generate(...)`` through transformers' own decoding loop: a linearize model's ``generate()``
    takes the fast decoder by default (``linearize.decode.route``), so it is asked for the plain loop
    (``fast_decoding=False``; other models take no such keyword). The reference the fast decoder is checked
    against, and the path of the mixers' cache layers."""
    from linearize.decode.route import plain_loop

    return model.generate(*args, **plain_loop(model), **kwargs)


def cache_bytes_after(model, n: int) -> int:
    """Bytes a ``LinearizeCache`` holds after greedy ``generate()`` of exactly ``n`` tokens from an 8-token prompt."""
    from linearize.cache import LinearizeCache, cache_nbytes

    cache = LinearizeCache(model)
    plain_generate(model, torch.ones(1, 8, dtype=torch.long), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                   past_key_values=cache, pad_token_id=0)
    return cache_nbytes(cache)


def gated_student(tiny_model, spec, family="llama", dtype=torch.float64):
    """A tiny student of ``spec`` whose gates differ per head and token (a zero gate projection, as conversion
    leaves it, would hide the data path), its learned mix and gate biases moved off their start, no EOS."""
    import linearize
    from linearize.convert import mixers

    student = linearize.convert(tiny_model(family, dtype=dtype), spec)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in mixers(student).values():
            if hasattr(m, "gate_proj"):
                m.gate_proj.weight.copy_(torch.randn(m.gate_proj.weight.shape, generator=gen) * 0.5)
            if hasattr(m, "mix_logit"):
                m.mix_logit.add_(torch.randn(m.mix_logit.shape, generator=gen, dtype=m.mix_logit.dtype))
            if hasattr(m, "gate_bias"):
                m.gate_bias.add_(torch.randn(m.gate_bias.shape, generator=gen, dtype=m.gate_bias.dtype) * 0.3)
    student.generation_config.eos_token_id = None
    return student


def left_padded(prompts):
    """``(ids, mask)`` of 1-D prompts padded on the left with token 0."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    return ids, mask


def fused_hybrid_steps(q, k, v, cos, sin, fq, fk, logit, key_mask, *, window, t, n, softcap, splits):
    """The LoLCATs decode step twice from one prefill of ``t`` tokens: the PyTorch ring step after RoPE
    and the Hedgehog maps ``fq``/``fk``, and the fused Triton step on the raw q/k/v (``cos`` None: no
    RoPE). Yields ``(fused, reference)`` outputs for tokens ``t .. t + n - 1``, then the two final
    states as ``(FusedRingState, RingHybridState)``."""
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb  # full or partial

    from linearize import ops
    from linearize.ops.hybrid.step_triton import hybrid_step_fused_triton

    rq, rk = apply_rotary_pos_emb(q, k, cos, sin) if cos is not None else (q, k)
    gamma = torch.sigmoid(logit)
    kw = dict(scale=q.shape[-1] ** -0.5, softcap=softcap)
    pre = slice(0, t)
    _, state = ops.hybrid_attention_chunked(rq[:, :, pre], rk[:, :, pre], fq(rq[:, :, pre]), fk(rk[:, :, pre]),
                                            v[:, :, pre], gamma, window=window, **kw, output_final_state=True,
                                            key_mask=key_mask)
    ref = ops.RingHybridState.from_state(state, window, keep_key_features=False)
    mine = ops.FusedRingState.from_ring(ref.map(lambda x: x.clone()), fk, q.shape[1], splits)
    for i in range(t, t + n):
        sl = slice(i, i + 1)
        want, ref = ops.hybrid_attention_step_ring(rq[:, :, sl], rk[:, :, sl], fq(rq[:, :, sl]), None, v[:, :, sl],
                                                   gamma, ref, **kw, key_feature_map=fk)
        pe = (cos[:, sl], sin[:, sl]) if cos is not None else None
        yield hybrid_step_fused_triton(q[:, :, sl], k[:, :, sl], v[:, :, sl], pe, fq.weight, fk.weight, logit, mine,
                                       **kw), want
    yield mine, ref


def fused_sink_steps(q, k, v, cos, sin, fq, fk, logit, key_mask, *, window, cap, t, n, softcap, splits, anchor):
    """The LoLCATs decode step with a cache of the first ``cap`` tokens (attention sinks, full after a
    prefill of ``t`` tokens) twice: the sparse cache's PyTorch ring step (``RingSparseState``) after RoPE
    and the Hedgehog maps, and the fused Triton step on a ``FusedSinkState`` from the raw q/k/v (``cos``
    None: no RoPE). Yields ``(fused, reference)`` outputs for tokens ``t .. t + n - 1``, then the two
    final states as ``(FusedSinkState, RingSparseState)``."""
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb  # full or partial

    from linearize import ops
    from linearize.ops.hybrid.step_triton import hybrid_step_fused_triton

    rq, rk = apply_rotary_pos_emb(q, k, cos, sin) if cos is not None else (q, k)
    gamma = torch.sigmoid(logit)
    kw = dict(scale=q.shape[-1] ** -0.5, softcap=softcap)
    pre = slice(0, t)
    _, state = ops.sparse_hybrid_attention_chunked(rq[:, :, pre], rk[:, :, pre], fq(rq[:, :, pre]), fk(rk[:, :, pre]),
                                                   v[:, :, pre], gamma, window=window, cache_size=cap, **kw,
                                                   output_final_state=True, key_mask=key_mask, priority="first",
                                                   anchor=anchor)
    assert ops.FusedSinkState.settled(state, "first") and not ops.FusedSinkState.settled(state, "recall")
    ref = ops.RingSparseState.from_state(state.map(lambda x: x.clone()), window)
    mine = ops.FusedSinkState.from_sparse(state.map(lambda x: x.clone()), window, fk, q.shape[1], splits)
    mine = mine.map(lambda x: x)  # what a batch reorder does: still the sinks' state
    assert isinstance(mine, ops.FusedSinkState) and mine.sink_keys is not None
    for i in range(t, t + n):
        sl = slice(i, i + 1)
        want, ref = ops.sparse_hybrid_attention_step_ring(rq[:, :, sl], rk[:, :, sl], fq(rq[:, :, sl]), fk(rk[:, :, sl]),
                                                          v[:, :, sl], gamma, ref, **kw, priority="first", anchor=anchor)
        pe = (cos[:, sl], sin[:, sl]) if cos is not None else None
        yield hybrid_step_fused_triton(q[:, :, sl], k[:, :, sl], v[:, :, sl], pe, fq.weight, fk.weight, logit, mine,
                                       **kw, anchor=anchor), want
    yield mine, ref


def one_line(err) -> str:
    """The message of a raised error (a ``pytest.raises`` result), checked to be one non-empty line."""
    message = str(err.value)
    assert message and "\n" not in message
    return message


class CollectStreamer:
    """A ``generate()`` streamer that keeps what it is given (``parts``) and whether it was ended."""

    def __init__(self):
        self.parts, self.ended = [], False

    def put(self, x):
        self.parts.append(x.reshape(-1))

    def end(self):
        self.ended = True


def greedy_step_reference(logits, token, following, position, position_ids, finished, eos, pad):
    """The PyTorch lines of a greedy decode step's bookkeeping (``decode.loop.DecodeStep``) that
    ``ops/pick_triton.py``'s one launch stands for, in place."""
    import torch

    torch.argmax(logits, dim=-1, keepdim=True, out=token)
    if eos is not None:
        token.masked_fill_(finished[:, None], pad)
        finished.logical_or_(torch.isin(token[:, 0], eos))
    following.index_copy_(1, position.view(1), token)
    position_ids.add_(1)
    position.add_(1)
