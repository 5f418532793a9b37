"""bench.profile on the CPU: operators per training step and per decode step, from tiny models."""

import torch

from helpers import tiny_config

import linearize
from linearize.bench import profile


def _tiny_teacher():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama")).float()


def test_train_profile_lists_the_step_operators():
    out = profile.profile_train(_tiny_teacher(), "supra", 2, 16, steps=1, warmup=1, top=50, python_top=200)
    names = [r["name"] for r in out["top"]]
    assert out["unit"] == "operator" and out["us_per_step"] > 0
    assert "aten::mm" in names or "aten::addmm" in names  # the projections, forward and backward
    assert "aten::native_layer_norm" in names  # SUPRA's per-head GroupNorm (as a layer norm) ran in the step
    assert out["launches_per_step"] >= sum(r["launches_per_step"] for r in out["top"][:5])
    assert out["wall_us_per_step"] > 0 and out["gpu_busy_us_per_step"] == 0.0  # no device kernels on the CPU
    assert "wall time per step" in profile.render(out)
    assert set(out["host_phases_us"]) == {"forward", "backward", "optimizer", "drain"}
    assert out["host_phases_us"]["backward"] > 0 and out["host_phases_us"]["forward"] > 0
    python = {r["name"].split(" (")[0]: r for r in out["python"]}
    assert "forward" in python and python["forward"]["cum_us_per_step"] >= python["forward"]["own_us_per_step"] > 0


def test_train_profile_of_a_lolcats_stage_and_its_cuda_graph_flag():
    """A LoLCATs stage row profiles its own loss; ``--cuda-graph`` needs a CUDA device (one line)."""
    from linearize import LinearizeError

    out = profile.profile_train(_tiny_teacher(), "lolcats-stage1", 2, 16, steps=1, warmup=1, top=50)
    assert out["model"] == "lolcats-stage1" and out["cuda_graph"] is False and out["us_per_step"] > 0
    if not torch.cuda.is_available():
        try:
            profile.profile_train(_tiny_teacher(), "lolcats-stage2", 2, 16, steps=1, warmup=1, cuda_graph=True)
        except LinearizeError as e:
            assert str(e) == "--cuda-graph needs a CUDA device"
        else:
            raise AssertionError("profiled a graphed step without CUDA")


def test_gpu_busy_is_the_union_of_the_kernel_intervals():
    from types import SimpleNamespace as NS

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(start, end, device=cuda):
        return NS(device_type=device, time_range=NS(start=start, end=end))

    # kernels [0, 10] and [5, 12] overlap (12 us busy), a gap, then [20, 25]; a host event is ignored
    prof = NS(events=lambda: [ev(20, 25), ev(0, 10), ev(5, 12), ev(0, 100, cpu)])
    assert profile.gpu_busy(prof) == (17.0, 25.0)
    assert profile.gpu_busy(NS(events=lambda: [])) == (0.0, 0.0)


def test_decode_profile_counts_operators_per_step_not_the_prefill():
    student = linearize.convert(_tiny_teacher(), {"kind": "supra"})
    short = profile.profile_decode(student, batch=1, tokens=2, prompt_len=8)
    longer = profile.profile_decode(student, batch=1, tokens=6, prompt_len=8)
    # per step, the same model launches about the same operators whatever the number of steps
    assert short["launches_per_step"] > 0
    assert abs(short["launches_per_step"] - longer["launches_per_step"]) <= 0.25 * longer["launches_per_step"]
    text = profile.render(longer)
    assert "decode" in text and "operator launches per step" in text


def test_fused_projections_cut_the_decode_step_operators():
    """One product for q/k/v and one for gate/up: at least 3 fewer matrix products per layer and step."""
    student = linearize.convert(_tiny_teacher(), {"kind": "lolcats"})
    counts = {}
    for fused in (True, False):
        out = profile.profile_decode(student, batch=1, tokens=4, prompt_len=8, top=10**6, fuse_projections=fused)
        counts[fused] = sum(r["launches_per_step"] for r in out["top"] if r["name"] in ("aten::mm", "aten::addmm"))
    layers = student.config.num_hidden_layers
    assert counts[False] - counts[True] >= 3 * layers - 0.5, counts


def test_prefill_profile_counts_operators_per_layer():
    """bench.profile prefill: a prefill's operators per decoder layer, for a student in either form."""
    student = linearize.convert(_tiny_teacher(), {"kind": "lolcats", "window": 4, "feature_dim": 8})
    out = profile.profile_prefill(student, batch=1, prompt_len=12, steps=1, top=100, backend="torch")
    assert out["unit"] == "operator" and out["what"] == "prefill" and out["backend"] == "torch"
    assert out["launches_per_layer"] == out["launches_per_step"] / 3 > 0
    assert "launches per decoder layer" in profile.render(out)
    teacher = profile.profile_prefill(_tiny_teacher(), batch=1, prompt_len=12, steps=1)
    assert teacher["model"] == "teacher" and 0 < teacher["launches_per_step"] < out["launches_per_step"]
    assert "python" not in out
    hosted = profile.profile_prefill(student, batch=1, prompt_len=12, steps=1, top=5, backend="torch", python_top=4)
    assert len(hosted["python"]) == 4 and all(r["calls_per_step"] >= 1 for r in hosted["python"])
    assert hosted["python"][0]["own_us_per_step"] >= hosted["python"][-1]["own_us_per_step"] > 0
    assert "Python function (cProfile)" in profile.render(hosted)
