"""The ready-made accelerate configurations for several GPUs (``linearize.recipes.launch``)."""

import subprocess
import sys

import pytest
import torch
import yaml

from linearize.errors import LinearizeError
from linearize.recipes.launch import CONFIGS, config_path


def test_ddp_and_fsdp_configs_are_accelerate_configs():
    assert set(CONFIGS) >= {"ddp", "fsdp"}
    ddp = yaml.safe_load(config_path("ddp").read_text())
    fsdp = yaml.safe_load(config_path("fsdp").read_text())
    assert ddp["distributed_type"] == "MULTI_GPU" and fsdp["distributed_type"] == "FSDP"
    assert ddp["mixed_precision"] == fsdp["mixed_precision"] == "bf16"
    assert fsdp["fsdp_config"]["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    with pytest.raises(LinearizeError, match="choose from"):
        config_path("zero3")


def test_the_module_prints_a_path_or_one_error_line():
    ok = subprocess.run([sys.executable, "-m", "linearize.recipes.launch", "fsdp"], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.strip().endswith("fsdp.yaml")
    bad = subprocess.run([sys.executable, "-m", "linearize.recipes.launch", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("linearize: error:") and bad.stderr.count("\n") == 1


def test_stage_two_under_fsdp_merges_or_is_refused_before_the_teacher_loads(monkeypatch, capsys, tmp_path):
    """Under FSDP stage 2's adapters are merged into the saved student; a run asking to keep them apart
    (merge: false) is refused with one line, before any model loads."""
    import time

    from linearize.recipes import lolcats

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    start = time.perf_counter()
    cfg = lolcats.LolcatsConfig(teacher=str(tmp_path / "absent"), out=str(tmp_path / "run"), merge=False)
    with pytest.raises(LinearizeError, match="merge: false keeps stage 2's LoRA adapters apart") as err:
        lolcats.run(cfg)
    assert "\n" not in str(err.value) and time.perf_counter() - start < 5


def test_lora_merged_under_fsdp_matches_one_process(tmp_path):
    """Two gloo processes with a LoRA student's decoder layers and model sharded by FSDP2: the main process's
    gathered, merged student equals one unsharded process's ``merge_and_unload``; the other keeps no copy."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from helpers import run_two_processes

    script = Path(__file__).with_name("fsdp_lora_merge.py")
    one = subprocess.run([sys.executable, str(script), str(tmp_path)], env={**os.environ, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "merged alike" in run_two_processes(script, str(tmp_path))


def test_attention_transfer_under_fsdp_matches_one_process(tmp_path):
    """Two gloo processes with every decoder layer and the model sharded by FSDP2 (as accelerate's
    FSDP config does), each on half the batch: attention transfer's loss and gathered gradients equal
    one unsharded process's on the whole batch. Without the loss's zero-weighted logits term the
    backward meets weights FSDP already freed."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from helpers import run_two_processes

    script = Path(__file__).with_name("fsdp_attention_transfer.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "gradients agree" in run_two_processes(script, str(tmp_path))


def test_the_softmax_layers_are_chosen_alike_on_a_sharded_student(tmp_path):
    """keep_softmax auto:K under FSDP: two gloo processes, the student's decoder layers and model sharded by FSDP2,
    make the greedy choice of ``recall_choice`` (the trunk and head called apart, layers resumed from recorded
    outputs) with the same layers and round losses as one unsharded process."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from helpers import run_two_processes

    script = Path(__file__).with_name("fsdp_recall_choice.py")
    one = subprocess.run([sys.executable, str(script), str(tmp_path)], env={**os.environ, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "chosen alike" in run_two_processes(script, str(tmp_path))


def test_under_fsdp_the_teacher_loads_on_the_cpu_and_nothing_is_measured_before_sharding(monkeypatch, capsys,
                                                                                         workspace, tmp_path):
    """begin_run under accelerate's FSDP config: the teacher is loaded on the CPU, not on the device a
    plain load picks (here a stand-in for the process's GPU: the meta device, which holds no data), its
    perplexity is not measured, and results.json's skipped says why; one line says so. Without FSDP the
    teacher goes where a plain load puts it and is measured (on the CPU, for that part)."""
    from linearize import teacher as teacher_module
    from linearize.recipes.common import begin_run
    from linearize.recipes.supra import SupraConfig

    cfg = SupraConfig(teacher=str(workspace / "teacher"), data=str(workspace / "corpus.jsonl"), out=str(tmp_path / "run"),
                      block_len=32, eval_blocks=2, train_blocks=8)
    real = teacher_module.resolve_device
    monkeypatch.setattr(teacher_module, "resolve_device", lambda d: torch.device("meta") if d is None else real(d))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    _, teacher, *_, results = begin_run(cfg, skip_under_fsdp=("perplexity: student, before training",))
    assert results["teacher_loaded_on"] == "cpu" and {p.device.type for p in teacher.parameters()} == {"cpu"}
    assert results["perplexity"] == {}
    assert list(results["skipped"]) == ["perplexity: teacher", "perplexity: student, before training"]
    assert all("FSDP" in why for why in results["skipped"].values())
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("linearize:")]
    assert len(said) == 1 and said[0].startswith("linearize: under FSDP the teacher loads on the CPU")
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    monkeypatch.setattr(teacher_module, "resolve_device", real)
    _, teacher, *_, results = begin_run(cfg)
    assert "skipped" not in results and results["perplexity"]["teacher"] > 1


@pytest.mark.parametrize("recipe", ["supra", "xatl", "lolcats", "lolcats-checkpointed", "lolcats-both", "lolcats-auto"])
def test_distillation_under_the_fsdp_config_on_two_processes(recipe, workspace, tmp_path):
    """`accelerate launch` with the packaged FSDP config (on the CPU: gloo, no mixed precision): SUPRA or
    XATL with an alignment stage and KL distillation runs end to end on 2 processes, the frozen teacher
    (SUPRA's a copy, XATL's the teacher itself) sharded over both like the student, and the saved
    student stands alone; LoLCATs' stage 1 alone likewise, also with its layers recomputed in the backward. The teacher was loaded on the CPU, nothing
    was measured before the training (results.json says why), and the trained student's perplexity was.
    (On the CPU accelerate trains the student data-parallel: what FSDP does to it is for GPU runs.)"""
    import json
    import math
    import os
    import subprocess
    import sys

    import yaml

    import linearize
    from linearize.recipes.launch import config_path

    cfg = yaml.safe_load(config_path("fsdp").read_text())
    cfg.update(use_cpu=True, mixed_precision="no")
    (tmp_path / "fsdp_cpu.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "LINEARIZE_HOME": str(tmp_path / "home")}
    checkpointed = recipe.endswith("-checkpointed")  # --gradient-checkpointing: the probes stay for the backward
    auto = recipe.endswith("-auto")  # both stages, keep_softmax auto:1: the chosen layer kept in the student made again
    both = recipe.endswith("-both") or auto  # stage 2 too: its adapters merged into the gathered student
    recipe = recipe.removesuffix("-checkpointed").removesuffix("-both").removesuffix("-auto")
    if recipe == "lolcats":
        options = [*([] if both else ["--rows", "stage1-only"]), "--stage1-steps", "4", "--stage2-steps", "3",
                   "--window", "4", "--feature-dim", "8", *(["--gradient-checkpointing"] if checkpointed else []),
                   *(["--keep-softmax", "auto:1", "--auto-softmax-score", "recall"] if auto else [])]
    else:
        options = ["--steps", "4", "--loss", "kl+lm", "--align-steps", "2",
                   *(["--arch", "retnet", "--transfer", "embeddings,ffn"] if recipe == "xatl" else [])]
    done = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "fsdp_cpu.yaml"),
         "--num_processes", "2", "-m", "linearize", recipe, "--teacher", str(workspace / "teacher"),
         "--data", str(workspace / "corpus.jsonl"), "--out", str(tmp_path / "run"), "--budget", "cpu",
         "--block-len", "32", "--batch-size", "2", "--eval-blocks", "4", "--eval-steps", "2",
         "--dtype", "float32", "--device", "cpu", *options],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("linearize: under FSDP the teacher loads on the CPU") == 1  # the main process's line
    run = tmp_path / "run" / ("stage1-only" if recipe == "lolcats" and not both else "")
    res = json.loads((run / "results.json").read_text())
    assert res["teacher_loaded_on"] == "cpu" and "teacher" not in res["perplexity"]
    if recipe == "lolcats":
        skipped = {"perplexity: teacher", "perplexity: converted", "layer_mse_before"}
        stages = ["after_stage1", "after_stage2"] if both else ["after_stage1"]
        if auto:  # measured on the sharded student before the choice; the chosen one is sharded by stage 2 first
            skipped.add("perplexity: after_stage1")
            stages = ["after_stage1, every layer linear", "after_stage2"]
        assert set(res["skipped"]) == skipped
        assert list(res["perplexity"]) == stages and all(math.isfinite(res["perplexity"][s]) for s in stages)
        assert res["train"]["steps"] == (7 if both else 4) and len(res["layer_mse_after"]) == 3
    else:
        assert "sharded over 2 processes" in done.stdout, done.stdout[-2000:]
        assert set(res["skipped"]) == {"perplexity: teacher", "perplexity: student, before training"}
        assert math.isfinite(res["perplexity"]["student, after training"])
        assert res["teacher_sharded_over"] == 2 and res["train"]["steps"] == 6
        assert res["train"]["tokens"] == 6 * 2 * 32 * 2  # both processes' batches
    model, _ = linearize.load(run / "final", device="cpu")
    assert linearize.mixers(model) and not any("lora" in name for name, _ in model.named_parameters())  # merged
    if both:  # stage 2 started from stage 1's saved weights on every process (no gather): its maps are those
        from safetensors.torch import load_file

        trained = load_file(str(run / "stage1" / "joint" / "trained.safetensors"))
        state = model.state_dict()
        if auto:  # the chosen layer kept softmax, recorded; every other layer's maps those stage 1 trained
            kept = res["auto_softmax"]["chosen"]
            assert len(kept) == 1 and model.config.linearize["auto_softmax"]["chosen"] == kept
            assert sorted(linearize.mixers(model)) == [i for i in range(3) if i not in kept]
            trained = {n: v for n, v in trained.items() if f"layers.{kept[0]}." not in n}
        assert trained and all(torch.equal(state[name], value.to(state[name].dtype)) for name, value in trained.items())


def test_a_student_on_the_cpu_samples_on_the_gpu_where_it_fits(monkeypatch, capsys):
    """Under FSDP the trained student is gathered on the CPU to be saved; its sample decodes on the GPU where the
    GPU has room for it (in bfloat16 where only that fits), on the CPU with one line where neither fits, and not
    at all, with one line, where the CPU would take too long (the CUDA calls stand in here)."""
    from linearize.recipes import common

    model = torch.nn.Linear(256, 256)  # 257 KiB of float32
    moved = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(model, "to", lambda *a: moved.append(a) or model)
    for free, expected in ((1 << 30, ("cuda",)), (200 << 10, ("cuda", torch.bfloat16))):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda free=free: (free, 1 << 31))
        moved.clear()
        assert common.sampling_device(model) is model and moved == [expected]
        assert capsys.readouterr().err == ""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (100 << 10, 1 << 31))
    moved.clear()
    assert common.sampling_device(model) is model and moved == []  # stays on the CPU
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "decodes on the CPU" in err and "does not fit the GPU's free" in err
    monkeypatch.setattr(common, "CPU_SAMPLE_BYTES", 100 << 10)
    assert common.sampling_device(model) is None and moved == []
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("linearize: no sample:") and "linearize generate" in err


def test_every_process_takes_the_main_process_choice():
    """The softmax layers each rank scores in a several-GPU run: all keep rank 0's (``rank0s``); every rank's peak
    memory and allocator retries are gathered (``peak_gpu_memory``)."""
    from pathlib import Path

    from helpers import run_two_processes

    assert "agreed" in run_two_processes(Path(__file__).with_name("rank0s.py"))


@pytest.mark.parametrize("local_rank, gpus, expected", [("1", 2, 1), ("0", 2, 0), (None, 2, None), ("3", 2, None)])
def test_a_launched_process_makes_its_own_gpu_current(monkeypatch, local_rank, gpus, expected):
    # under torchrun rank r's teacher loads on GPU r before the Trainer would make it current: kernels launched
    # for it from GPU 0 fail (the 8B ddp2 run of 2026-11-30 did in its first perplexity)
    from linearize.recipes.launch import bind_process_gpu

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    bind_process_gpu()
    assert chosen == ([] if expected is None else [expected])
