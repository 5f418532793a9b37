"""LoLCATs' training steps replayed from CUDA graphs (``linearize.graphed``) against the eager ones:
stage 1's attention_mse captured whole, stage 2's LoRA step, and the recipe under ``--cuda-graph on``
(skipped without CUDA; the LoLCATs hybrid runs on the project's own Triton kernels, not fla's)."""

import pytest
import torch

import linearize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _same_step_then_update(models, opts, eager, replayed, where) -> None:
    """The replayed step's loss within 2e-2 of the eager one's and each gradient within 5e-2 (relative),
    then one optimizer step on both models (as tests/gpu/test_gpu.py checks the uptraining students)."""
    assert abs(replayed.item() - eager.item()) <= 2e-2 * abs(eager.item()), (where, replayed.item(), eager.item())
    compared = 0
    for (n, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        if a.grad is not None:
            assert b.grad is not None, (where, n)
            rel = ((a.grad - b.grad).norm() / a.grad.norm().clamp_min(1e-12)).item()
            assert rel < 5e-2, (where, n, rel)
            compared += 1
    assert compared > 0
    for o in opts:
        o.step()
        o.zero_grad(set_to_none=True)


def _lolcats_pair(tiny_model, **spec):
    """Two equal LoLCATs students (Hedgehog maps, window 64; ``spec`` added) of one tiny teacher on CUDA."""
    teacher = tiny_model("llama", num_attention_heads=4, num_key_value_heads=2, hidden_size=256).cuda()
    models = [linearize.convert(teacher, {"kind": "lolcats", **spec}) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    return models


@pytest.mark.parametrize("xent", [0.0, 0.1])
def test_graphed_lolcats_stage1_steps_equal_eager_ones(tiny_model, xent):
    """LoLCATs stage 1 replayed from CUDA graphs: the attention_mse objective captured whole (its probes
    swapped in during the capture, the forward cut after the last layer) gives the eager step's loss and
    gradients of the feature maps and window weights, three steps in a row from one capture."""
    from linearize.distill import build_objective
    from linearize.graphed import GraphedLoss
    from linearize.recipes.lolcats import _freeze_all_but

    models = _lolcats_pair(tiny_model)
    for m in models:
        _freeze_all_but(m, set(range(m.config.num_hidden_layers)))
        m.train()
    objective = build_objective("attention_mse", context={"mse_factor": 1000.0, "xent_factor": xent})
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3) for m in models]
    graphed = GraphedLoss(models[1], torch.bfloat16, objective=objective)
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        ids = torch.randint(0, 97, (2, 128), generator=g).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            eager = objective(models[0], {"input_ids": ids, "labels": ids})
        eager.backward()
        replayed = graphed(ids, ids)
        replayed.backward()
        assert eager.item() > 0
        _same_step_then_update(models, opts, eager, replayed, step)
    assert graphed.captures == 1


@pytest.mark.parametrize("loss", ["lm", "kl"])
def test_graphed_lolcats_stage2_steps_equal_eager_ones(tiny_model, loss):
    """LoLCATs stage 2 replayed from CUDA graphs: LoRA (r=8 on q/k/v/o) on the next-token loss, or on kl
    to the student's own softmax view (computed eagerly before each replay, its logits entering the
    graphs), gives the eager step's loss and LoRA gradients, three steps in a row from one capture; with
    the recipe's fused adapters (``recipes.lora``), as ``linearize lolcats`` trains them."""
    from peft import LoraConfig, get_peft_model

    from linearize.distill import SameModelTeacher, build_objective
    from linearize.graphed import GraphedLoss
    from linearize.recipes.lora import fuse_lora_products

    models = []
    for m in _lolcats_pair(tiny_model):
        for p in m.parameters():
            p.requires_grad_(False)
        lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, bias="none",
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False)
        models.append(get_peft_model(m, lora))
        assert fuse_lora_products(models[-1]) == 4 * m.config.num_hidden_layers
        models[-1].train()
    models[1].load_state_dict(models[0].state_dict())
    objective = None if loss == "lm" else build_objective("kl", teacher=SameModelTeacher())
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3) for m in models]
    graphed = GraphedLoss(models[1], torch.bfloat16, objective=objective)
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        ids = torch.randint(0, 97, (2, 128), generator=g).cuda()
        batch = {"input_ids": ids, "labels": ids}
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            eager = (models[0](input_ids=ids, labels=ids, use_cache=False).loss if objective is None
                     else objective(models[0], batch))
        eager.backward()
        teacher = () if objective is None else objective.teacher_tensors(models[1], batch)
        replayed = graphed(ids, ids, *teacher)
        replayed.backward()
        assert eager.item() > 1e-4
        _same_step_then_update(models, opts, eager, replayed, step)
    assert graphed.captures == 1


@pytest.mark.parametrize("priority", ["first", "novelty", "recall"])
def test_graphed_sparse_cache_stages_equal_eager_ones(tiny_model, priority):
    """A student with a sparse cache (S = 4) trains through the cache's PyTorch chunked form, which asks
    the host nothing without padding: stage 1's attention_mse and stage 2's LoRA step replayed from one
    capture each give the eager steps' losses and gradients, three steps in a row (what lets the recipe
    capture a sparse cache under ``--cuda-graph auto``)."""
    from linearize.distill import build_objective
    from linearize.graphed import GraphedLoss
    from linearize.recipes.lolcats import _freeze_all_but
    from linearize.recipes.lora import add_lora

    spec = dict(window=16, sparse_cache=4, sparse_priority=priority)
    g = torch.Generator().manual_seed(0)
    for stage in ("stage1", "stage2"):
        models = _lolcats_pair(tiny_model, **spec)
        objective = None
        if stage == "stage1":
            for m in models:
                _freeze_all_but(m, set(range(m.config.num_hidden_layers)))
            objective = build_objective("attention_mse", context={"mse_factor": 1000.0, "xent_factor": 0.0})
        else:
            models = [add_lora(m, 8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"]) for m in models]
            with torch.no_grad():  # B = 0 at the start: make the adapters count
                for name, p in models[0].named_parameters():
                    if "lora_B" in name:
                        p.normal_(0, 0.02)
            models[1].load_state_dict(models[0].state_dict())
        for m in models:
            m.train()
        opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3) for m in models]
        graphed = GraphedLoss(models[1], torch.bfloat16, objective=objective)
        for step in range(3):
            ids = torch.randint(0, 97, (2, 96), generator=g).cuda()
            with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
                eager = (models[0](input_ids=ids, labels=ids, use_cache=False).loss if objective is None
                         else objective(models[0], {"input_ids": ids, "labels": ids}))
            eager.backward()
            replayed = graphed(ids, ids)
            replayed.backward()
            assert eager.item() > 1e-4
            _same_step_then_update(models, opts, eager, replayed, (stage, step))
        assert graphed.captures == 1


def test_the_lolcats_recipe_trains_graphed_end_to_end(tiny_model, tmp_path, monkeypatch):
    """``linearize lolcats --cuda-graph on``: both stages' Trainer steps (bf16, accelerate's autocast
    wrapper around the forward) go through the graphed loss and log the eager run's losses; the run
    records both stages as graphed and leaves a loadable checkpoint."""
    import json
    import random

    from helpers import tiny_tokenizer

    from linearize.graphed import GraphedLoss
    from linearize.recipes import lolcats

    teacher = tiny_model("llama", num_attention_heads=4, num_key_value_heads=2, hidden_size=256)
    teacher.save_pretrained(tmp_path / "teacher")
    tiny_tokenizer().save_pretrained(tmp_path / "teacher")
    rng = random.Random(0)
    (tmp_path / "corpus.jsonl").write_text("".join(
        json.dumps({"text": " ".join(f"w{rng.randrange(2, 97)}" for _ in range(200))}) + "\n" for _ in range(30)))
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    calls = []
    real = GraphedLoss.__call__
    monkeypatch.setattr(GraphedLoss, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
    losses, results = {}, {}
    for mode in ("off", "on"):
        cfg = lolcats.LolcatsConfig(teacher=str(tmp_path / "teacher"), data=str(tmp_path / "corpus.jsonl"),
                                    out=str(tmp_path / mode), block_len=128, batch_size=2, eval_blocks=2,
                                    eval_steps=2, patience=None, dtype="float32", stage1_steps=4, stage2_steps=4,
                                    stage2_lr=1e-3, sample_prompt="w5 w6 w7", cuda_graph=mode)
        results[mode] = lolcats.run(cfg)
        lines = [json.loads(x) for x in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
        losses[mode] = [(x["stage"], x["step"], x["loss"]) for x in lines if "loss" in x]
    assert results["on"]["cuda_graph"] == {"setting": "on", "stage1": {"graphed": True}, "stage2": {"graphed": True}}
    assert results["off"]["cuda_graph"] == {"setting": "off", "stage1": {"graphed": False},
                                            "stage2": {"graphed": False}}
    assert len(calls) == 8  # 4 steps of each stage, only in the graphed run
    assert [x[:2] for x in losses["on"]] == [x[:2] for x in losses["off"]] and losses["on"]
    for (_, _, a), (_, _, b) in zip(losses["on"], losses["off"]):
        assert a == pytest.approx(b, rel=5e-2), losses
    linearize.load(tmp_path / "on" / "final", device="cpu")
