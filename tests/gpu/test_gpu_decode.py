"""The fast decoder's CUDA graph against its eager twin, on CUDA (skipped elsewhere)."""

import pytest
import torch

import linearize
from helpers import plain_generate
from linearize.fast import fast_generate
from linearize.convert.xatl_transfer import build_xatl

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SPECS = [{"kind": "lolcats", "window": 4, "feature_dim": 8}, {"kind": "supra"},
         {"kind": "linear", "feature_map": "hedgehog", "feature_dim": 8},
         {"kind": "lolcats", "window": 4, "feature_dim": 8, "keep_softmax": [1]},
         {"kind": "lolcats", "window": 4, "feature_dim": 8, "sparse_cache": 3},  # the cache's ring, captured too
         {"kind": "lolcats", "window": 4, "feature_dim": 8, "sparse_cache": 3, "sparse_priority": "novelty"},
         # the first tokens with the linear terms weighed down: the PyTorch forms, not the sinks' kernels
         {"kind": "lolcats", "window": 4, "feature_dim": 8, "sparse_cache": 3, "sparse_priority": "first",
          "sparse_linear": 0.25},
         {"kind": "delta", "window": 4, "chunk_size": 8}]  # the delta rule's ring and memory


def _models(tiny_model):
    for spec in SPECS:
        yield str(spec), linearize.convert(tiny_model("llama", dtype=torch.float32).cuda(), spec)
    for arch in ("retnet", "mamba"):
        yield arch, build_xatl(tiny_model("llama", dtype=torch.float32, num_hidden_layers=4).cuda(), arch,
                               keep_softmax="xatl", seed=0)[0]
    yield "teacher", tiny_model("llama", dtype=torch.float32).cuda()
    gemma = tiny_model("gemma3_text", dtype=torch.float32, sliding_window=8).cuda()  # local layers 0, 1; global 2
    gemma.config._attn_implementation = "sdpa"
    yield "gemma3", gemma  # the local layers' rings beside the global layer's buffers
    yield "gemma3-keep_sliding", linearize.convert(gemma, {"kind": "lolcats", "window": 4, "feature_dim": 8,
                                                            "keep_sliding": True})


def test_cuda_graph_equals_eager_and_generate(tiny_model):
    torch.backends.cuda.matmul.allow_tf32 = False
    ids = torch.randint(2, 97, (3, 11), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    for name, model in _models(tiny_model):
        model.generation_config.eos_token_id = None
        graph = fast_generate(model, ids, mask, max_new_tokens=24, pad_token_id=0, cuda_graph=True)
        eager = fast_generate(model, ids, mask, max_new_tokens=24, pad_token_id=0, cuda_graph=False)
        ref = plain_generate(model, ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
        assert torch.equal(graph, eager), name
        assert (graph == ref).float().mean() > 0.95, name  # fp32 on GPU: a rare near-tie may flip


def test_lolcats_decodes_with_the_fused_step_compiled_or_not(tiny_model, monkeypatch):
    """On CUDA each LoLCATs layer's decode step is the one-launch Triton kernel, also inside a
    torch.compile'd step; its tokens are those of the previous path (RoPE and feature maps in
    PyTorch, then the ring-step kernel)."""
    from linearize.convert import mixers
    from linearize.mixers.lolcats import LolcatsAttention

    torch.backends.cuda.matmul.allow_tf32 = False
    model = linearize.convert(tiny_model("llama", dtype=torch.float32).cuda(), SPECS[0])
    model.generation_config.eos_token_id = None
    assert all(m.fused_decoding() for m in mixers(model).values())
    ids = torch.randint(2, 97, (3, 11), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # left padding: empty slots in the ring
    kw = dict(max_new_tokens=24, pad_token_id=0)
    eager = fast_generate(model, ids, mask, **kw, cuda_graph=False)
    compiled = fast_generate(model, ids, mask, **kw, compile=True)
    monkeypatch.setattr(LolcatsAttention, "fused_decoding", lambda self: False)
    before = fast_generate(model, ids, mask, **kw)
    assert (compiled == eager).float().mean() > 0.95
    assert (before == eager).float().mean() > 0.95  # fp32 on GPU: a rare near-tie may flip


def test_cuda_graph_sampling_runs_on_the_device(tiny_model):
    model = linearize.convert(tiny_model("llama").cuda(), {"kind": "lolcats", "window": 4, "feature_dim": 8})
    ids = torch.randint(2, 97, (4, 6), device="cuda")
    torch.manual_seed(0)
    a = fast_generate(model, ids, max_new_tokens=16, do_sample=True, temperature=0.9, top_k=20, top_p=0.9)
    torch.manual_seed(0)
    b = fast_generate(model, ids, max_new_tokens=16, do_sample=True, temperature=0.9, top_k=20, top_p=0.9)
    assert a.shape == (4, 22) and torch.equal(a, b)


def test_repeated_fast_decoding_leaves_no_memory_behind(tiny_model):
    """Each run's buffers and graph go with it; the warm-up stream is shared, since cuBLAS keeps a
    workspace per stream for the life of the process (a stream per step leaked 32 MiB each on the H100)."""
    model = linearize.convert(tiny_model("llama", dtype=torch.float32).cuda(), SPECS[0])
    ids = torch.randint(2, 97, (2, 9), device="cuda")
    fast_generate(model, ids, max_new_tokens=16, pad_token_id=0, cuda_graph=True)
    torch.cuda.synchronize()
    after_first = torch.cuda.memory_allocated()
    for _ in range(3):
        fast_generate(model, ids, max_new_tokens=16, pad_token_id=0, cuda_graph=True)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - after_first < 2**20
