"""A greedy decode step's bookkeeping as one Triton launch (``ops/pick_triton.py``) on CUDA (skipped elsewhere):
against the PyTorch lines it stands for at the vocabularies and batches decoding meets, replayed from a CUDA graph,
and the fast decoder with it against itself without it."""

import pytest
import torch

from helpers import greedy_step_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("v", [49152, 151936, 262144, 1000])  # SmolLM2's, Qwen2.5's, Gemma 3's, one block
@pytest.mark.parametrize("b", [1, 7, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("eos", [None, [2, 7]])
def test_greedy_step_kernel_equals_the_torch_lines_on_cuda(v, b, dtype, eos):
    from linearize.ops.pick_triton import PickBuffers, greedy_step_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    ids = None if eos is None else torch.tensor(eos, device="cuda")
    state = [torch.zeros(b, 1, dtype=torch.long, device="cuda"),
             torch.full((b, 9), -1, dtype=torch.long, device="cuda"), torch.tensor(0, device="cuda"), torch.arange(b, device="cuda")[:, None],
             torch.arange(b, device="cuda") % 3 == 1]
    twin = [x.clone() for x in state]
    work = PickBuffers.make(b, "cuda")
    for step in range(8):
        x = (torch.randn(b, 1, v, device="cuda", generator=g) * 4).to(dtype)
        x[0, 0, v // 2] = x[0, 0, v - 1] = x[0].max() + 1  # a tie across blocks: the first wins
        if eos is not None and step == 3:
            x[-1, 0, eos[1]] = 1e4
        token, seq, position, position_ids, finished = state
        greedy_step_triton(x[:, -1], token, seq[:, 1:], position, position_ids, work, finished if ids is not None
                           else None, ids, 0)
        greedy_step_reference(x[:, -1], twin[0], twin[1][:, 1:], twin[2], twin[3], twin[4], ids, 0)
        for got, want in zip(state, twin):
            assert torch.equal(got, want), (v, b, str(dtype), eos, step)
    torch.cuda.synchronize()
    assert (work.best == -(2**63)).all() and not work.counts.any()


def test_greedy_step_kernel_replays_from_a_cuda_graph():
    from linearize.ops.pick_triton import PickBuffers, greedy_step_triton

    b, v = 4, 49152
    logits = torch.randn(b, v, device="cuda")
    token, seq = torch.zeros(b, 1, dtype=torch.long, device="cuda"), torch.zeros(b, 40, dtype=torch.long, device="cuda")
    position, position_ids = torch.tensor(0, device="cuda"), torch.zeros(b, 1, dtype=torch.long, device="cuda")
    work = PickBuffers.make(b, "cuda")
    greedy_step_triton(logits, token, seq[:, 1:], position, position_ids, work)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        greedy_step_triton(logits, token, seq[:, 1:], position, position_ids, work)
    g = torch.Generator(device="cuda").manual_seed(1)
    for step in range(1, 20):
        logits.copy_(torch.randn(b, v, device="cuda", generator=g))
        graph.replay()
        assert torch.equal(token[:, 0], logits.argmax(-1)) and torch.equal(seq[:, step + 1], token[:, 0])
        assert int(position) == step + 1 and torch.equal(position_ids[:, 0], torch.full((b,), step + 1, device="cuda"))


@pytest.mark.parametrize("eos", [None, 5])
def test_fast_decoder_with_the_greedy_kernel_gives_the_same_tokens_on_cuda(eos, monkeypatch):
    from helpers import tiny_config
    from transformers import AutoModelForCausalLM

    import linearize
    from linearize.decode import FastDecoder, loop

    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    model = linearize.convert(teacher, {"kind": "lolcats", "window": 4, "feature_dim": 8}).cuda()
    ids = torch.randint(2, 97, (3, 9), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    plain = FastDecoder(model).generate(ids, mask, max_new_tokens=40, pad_token_id=0, eos_token_id=eos)
    monkeypatch.setattr(loop, "PICK_KERNEL", True)
    assert torch.equal(FastDecoder(model).generate(ids, mask, max_new_tokens=40, pad_token_id=0, eos_token_id=eos),
                       plain)
