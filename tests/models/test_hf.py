"""Checkpoints that the Hugging Face ecosystem loads as what they are (linearize.hf): AutoModelForCausalLM
after ``import linearize``, ``trust_remote_code=True`` without it, a refusal where linearize is missing,
checkpoints of the old form, dtypes, and the weights' sha256."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import linearize
from linearize import LinearizeError
from linearize.cache import cache_nbytes
from linearize.info import describe
from linearize.convert.xatl_transfer import build_xatl

from helpers import tiny_tokenizer

SRC = Path(__file__).resolve().parents[2] / "src"

STUDENTS = [
    ("llama", {"kind": "lolcats", "window": 4}),
    ("qwen3", {"kind": "supra"}),
    ("gpt_neox", {"kind": "linear", "feature_map": "t2r", "keep_softmax": [1]}),
    ("gemma2", {"kind": "lolcats", "window": 4}),
    ("llama", "xatl:retnet"),
    ("llama", "xatl:striped_mamba"),
]


def _student(tiny_model, family, spec, dtype=torch.float32):
    teacher = tiny_model(family, dtype=dtype, num_hidden_layers=4)
    if isinstance(spec, str) and spec.startswith("xatl:"):
        student, _ = build_xatl(teacher, spec.removeprefix("xatl:"), hybrid_softmax_layers="xatl", seed=0)
    else:
        student = linearize.convert(teacher, spec)
    with torch.no_grad():  # make the new parameters non-trivial so a lost tensor would show
        for name, p in student.named_parameters():
            if any(part in name for part in ("feature_map", "window_logit", "group_norm", "wq", "in_proj")):
                p.add_(torch.randn_like(p) * 0.1)
    return student.eval()


def _ids(b=2, t=10, seed=0):
    return torch.randint(2, 97, (b, t), generator=torch.Generator().manual_seed(seed))


def _env(tmp_path, **extra):
    """A subprocess environment: this tree's linearize first, offline, its own dynamic-module cache."""
    return {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"),
            "TOKENIZERS_PARALLELISM": "false", **extra}


def _python(code: str, tmp_path, timeout=300):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=_env(tmp_path), stdin=subprocess.DEVNULL, timeout=timeout)


@pytest.mark.parametrize("family,spec", STUDENTS, ids=[f"{f}-{s if isinstance(s, str) else s['kind']}" for f, s in STUDENTS])
def test_automodel_loads_the_student_as_linearize_load_does(tiny_model, tmp_path, family, spec):
    from transformers import AutoConfig, AutoModelForCausalLM

    student = _student(tiny_model, family, spec)
    linearize.save(student, tiny_tokenizer(), tmp_path / "ck")
    saved = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert saved["model_type"] == f"linearize_{family}"
    assert saved["architectures"] == [type(student).__name__] and type(student).__name__.startswith("Linearize")
    assert saved["auto_map"]["AutoModelForCausalLM"] == f"modeling_linearize.{type(student).__name__}"
    assert (tmp_path / "ck" / "modeling_linearize.py").is_file()

    config = AutoConfig.from_pretrained(tmp_path / "ck")
    assert config.model_type == f"linearize_{family}" and config.linearize["spec"] == student.config.linearize["spec"]
    auto = AutoModelForCausalLM.from_pretrained(tmp_path / "ck")
    loaded, _ = linearize.load(tmp_path / "ck", device="cpu")
    assert type(auto) is type(loaded) is type(student)
    assert sorted(linearize.mixers(auto)) == sorted(linearize.mixers(student))
    ids = _ids()
    with torch.no_grad():
        reference = student(ids).logits
        torch.testing.assert_close(auto(ids).logits, reference, atol=1e-5, rtol=0)
        torch.testing.assert_close(loaded(ids).logits, reference, atol=1e-5, rtol=0)
    assert auto.config.linearize == loaded.config.linearize == student.config.linearize


def _generate(model, ids, n):
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True)
    return out.sequences, cache_nbytes(out.past_key_values)


def test_automodel_generates_with_constant_memory_and_pipeline_works(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, pipeline
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    student = _student(tiny_model, "llama", {"kind": "lolcats", "window": 4})
    student.generation_config.eos_token_id = None
    linearize.save(student, tiny_tokenizer(), tmp_path / "ck")
    auto = AutoModelForCausalLM.from_pretrained(tmp_path / "ck")
    auto.generation_config.eos_token_id = None
    prompt = _ids(b=1, t=6)
    short, short_bytes = _generate(auto, prompt, 4)
    long, long_bytes = _generate(auto, prompt, 24)
    assert short_bytes == long_bytes > 0  # every layer recurrent: the state does not grow
    assert torch.equal(long[:, :10], short)
    assert torch.equal(long, _generate(student, prompt, 24)[0])

    generator = pipeline("text-generation", model=str(tmp_path / "ck"), device="cpu")
    assert type(generator.model) is type(student)
    assert type(student).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
    text = generator("w5 w6 w7 w8", max_new_tokens=6, do_sample=False, return_full_text=False)[0]["generated_text"]
    ids = tiny_tokenizer()("w5 w6 w7 w8", return_tensors="pt").input_ids
    with torch.no_grad():
        want = auto.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert text.split() == tiny_tokenizer().decode(want[0, ids.shape[1]:]).split()


def test_trust_remote_code_loads_without_importing_linearize(tiny_model, tmp_path):
    student = _student(tiny_model, "qwen3", {"kind": "lolcats", "window": 4})
    student.generation_config.eos_token_id = None
    linearize.save(student, tiny_tokenizer(), tmp_path / "ck")
    ids = _ids()
    with torch.no_grad():
        torch.save({"ids": ids, "logits": student(ids).logits, "tokens": _generate(student, ids[:1, :6], 20)[0]},
                   tmp_path / "reference.pt")
    done = _python(f"""
        import sys
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        assert "linearize" not in sys.modules
        config = AutoConfig.from_pretrained({str(tmp_path / 'ck')!r}, trust_remote_code=True)
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'ck')!r}, trust_remote_code=True)
        model.generation_config.eos_token_id = None
        ref = torch.load({str(tmp_path / 'reference.pt')!r})
        from linearize.cache import cache_nbytes
        with torch.no_grad():
            diff = (model(ref["ids"]).logits - ref["logits"]).abs().max().item()
            sizes, tokens = [], None
            for n in (4, 20):
                out = model.generate(ref["ids"][:1, :6], max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                     pad_token_id=0, return_dict_in_generate=True)
                sizes.append(cache_nbytes(out.past_key_values))
                tokens = out.sequences
        print(type(config).__name__, type(model).__name__, type(model).__module__, diff, sizes[0] == sizes[1],
              torch.equal(tokens, ref["tokens"]))
    """, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    config_cls, model_cls, module, diff, constant, same = done.stdout.split()
    assert (config_cls, model_cls, module) == ("LinearizeQwen3Config", "LinearizeQwen3ForCausalLM", "linearize.hf")
    assert float(diff) <= 1e-5 and constant == "True" and same == "True"


def test_transformers_without_linearize_refuses_the_checkpoint(tiny_model, tmp_path):
    student = _student(tiny_model, "llama", {"kind": "lolcats", "window": 4})
    linearize.save(student, tiny_tokenizer(), tmp_path / "ck")
    code = """
        import sys
        sys.modules["linearize"] = None  # linearize cannot be imported here
        from transformers import AutoModelForCausalLM
        for trust in (None, True):
            try:
                model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, trust_remote_code=trust)
            except Exception as exc:
                print("\\nRESULT", type(exc).__name__, "|", " ".join(str(exc).split()))
            else:
                print("\\nRESULT LOADED", type(model).__name__)
    """
    done = _python(code.replace("CHECKPOINT", repr(str(tmp_path / "ck"))), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    plain, trusted = [line.removeprefix("RESULT ") for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert plain.startswith("ValueError |") and "trust_remote_code=True" in plain  # transformers will not guess
    assert trusted.startswith("ImportError |") and "linearize model" in trusted and "pip install linearize" in trusted


def _old_form(folder: Path) -> None:
    """Rewrite a checkpoint as linearize wrote them before students had their own model type."""
    config = json.loads((folder / "config.json").read_text())
    base = config["model_type"].removeprefix("linearize_")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config.update(model_type=base, architectures=[MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[base]])
    config.pop("auto_map")
    config["linearize"] = {k: config["linearize"][k] for k in ("spec", "keep_softmax", "version")}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "modeling_linearize.py").unlink()


@pytest.mark.parametrize("family,spec", [("llama", {"kind": "lolcats", "window": 4}), ("llama", "xatl:retnet")])
def test_old_checkpoints_load_and_are_upgraded_when_saved(tiny_model, tmp_path, family, spec):
    from transformers import AutoModelForCausalLM

    student = _student(tiny_model, family, spec)
    linearize.save(student, tiny_tokenizer(), tmp_path / "old")
    _old_form(tmp_path / "old")
    if isinstance(spec, str):  # XATL's record rides along in old checkpoints too
        config = json.loads((tmp_path / "old" / "config.json").read_text())
        config["linearize"]["xatl"] = student.config.linearize["xatl"]
        (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    loaded, tok = linearize.load(tmp_path / "old", device="cpu")
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, student(ids).logits, atol=1e-5, rtol=0)
    assert type(loaded) is type(student)
    assert "not recorded" in describe(loaded)

    linearize.save(loaded, tok, tmp_path / "new")
    config = json.loads((tmp_path / "new" / "config.json").read_text())
    assert config["model_type"] == f"linearize_{family}" and "auto_map" in config
    assert (tmp_path / "new" / "modeling_linearize.py").is_file()
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(tmp_path / "new")(ids).logits,
                                   student(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("saved_dtype", [torch.float32, torch.bfloat16])
def test_dtypes_match_linearize_load(tiny_model, tmp_path, saved_dtype):
    from transformers import AutoModelForCausalLM

    student = _student(tiny_model, "llama", {"kind": "supra"}, dtype=saved_dtype)
    linearize.save(student, tiny_tokenizer(), tmp_path / "ck")
    ids = _ids()
    for dtype in (None, torch.float32, torch.bfloat16):
        auto = AutoModelForCausalLM.from_pretrained(tmp_path / "ck", **({"dtype": dtype} if dtype else {}))
        loaded, _ = linearize.load(tmp_path / "ck", dtype=dtype, device="cpu")
        want = dtype or saved_dtype
        assert {p.dtype for p in auto.parameters()} == {p.dtype for p in loaded.parameters()} == {want}
        decays = [(a.log_decay, b.log_decay) for a, b in zip(linearize.mixers(auto).values(), linearize.mixers(loaded).values())]
        assert all(torch.equal(a, b) and a.dtype == torch.float32 for a, b in decays)  # constants stay float32
        with torch.no_grad():
            assert torch.equal(auto(ids).logits, loaded(ids).logits)


def test_save_pretrained_alone_writes_a_complete_checkpoint(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    student = _student(tiny_model, "llama", {"kind": "lolcats", "window": 4})
    student.save_pretrained(tmp_path / "ck")  # what Trainer and users call
    config = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert set(config["linearize"]["weights_sha256"]) == {"model.safetensors"}
    assert config["linearize"]["weights_sha256"] == student.config.linearize["weights_sha256"]
    assert (tmp_path / "ck" / "modeling_linearize.py").is_file()
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(tmp_path / "ck")(_ids()).logits,
                                   student(_ids()).logits, atol=1e-5, rtol=0)


def test_changed_weights_fail_the_sha256_check(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    student = _student(tiny_model, "llama", {"kind": "lolcats", "window": 4})
    linearize.save(student, tiny_tokenizer(), tmp_path / "ck")
    weights = tmp_path / "ck" / "model.safetensors"
    tensors = load_file(weights)
    name = next(k for k in tensors if "feature_map" in k)
    tensors[name] = tensors[name] + 1
    save_file(tensors, weights, metadata={"format": "pt"})
    for load in (lambda: linearize.load(tmp_path / "ck", device="cpu"),
                 lambda: AutoModelForCausalLM.from_pretrained(tmp_path / "ck")):
        with pytest.raises(LinearizeError, match="does not match the sha256 recorded") as err:
            load()
        assert "\n" not in str(err.value)


def test_missing_or_extra_tensors_are_an_error_not_a_random_init(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    student = _student(tiny_model, "llama", {"kind": "lolcats", "window": 4})
    linearize.save(student, tiny_tokenizer(), tmp_path / "ck")
    config = json.loads((tmp_path / "ck" / "config.json").read_text())
    del config["linearize"]["weights_sha256"]  # this test edits the weights on purpose
    (tmp_path / "ck" / "config.json").write_text(json.dumps(config))
    weights = tmp_path / "ck" / "model.safetensors"
    tensors = load_file(weights)
    lost = next(k for k in tensors if "window_logit" in k)
    save_file({k: v for k, v in tensors.items() if k != lost}, weights, metadata={"format": "pt"})
    for load in (lambda: linearize.load(tmp_path / "ck", device="cpu"),
                 lambda: AutoModelForCausalLM.from_pretrained(tmp_path / "ck")):
        with pytest.raises(LinearizeError, match="lacks"):
            load()
    save_file({**tensors, "model.layers.0.self_attn.extra": torch.zeros(2)}, weights, metadata={"format": "pt"})
    with pytest.raises(LinearizeError, match="does not use"):
        linearize.load(tmp_path / "ck", device="cpu")


def test_training_records(tiny_model, tmp_path):
    from linearize.checkpoint import describe_training, is_untrained, record_training

    teacher = tiny_model("llama")
    teacher.linearize_source = "tiny-llama-teacher"
    student = linearize.convert(teacher, "lolcats")
    record = student.config.linearize
    assert record["teacher"] == "tiny-llama-teacher" and record["training"] == [] and is_untrained(student)
    entry = record_training(student, "lolcats", 12345, steps=6, data=tmp_path / "corpus.jsonl", stages=["stage1"])
    assert entry["recipe"] == "lolcats" and entry["tokens"] == 12345 and entry["data"] == str(tmp_path / "corpus.jsonl")
    linearize.save(student, tiny_tokenizer(), tmp_path / "ck")
    loaded, _ = linearize.load(tmp_path / "ck", device="cpu")
    assert not is_untrained(loaded) and loaded.config.linearize["training"] == [entry]
    assert describe_training(loaded).startswith("lolcats, 12,345 tokens, 20")
    with pytest.raises(LinearizeError, match="not a linearize student"):
        record_training(tiny_model("llama"), "lolcats", 1)


def test_bad_records_fail_with_one_line(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    student = _student(tiny_model, "llama", {"kind": "lolcats", "window": 4})
    linearize.save(student, tiny_tokenizer(), tmp_path / "ck")
    config = json.loads((tmp_path / "ck" / "config.json").read_text())
    for record, match in (({"keep_softmax": []}, "has no spec"), ({"spec": {"kind": "mamba"}}, "spec kind must be one of"),
                          ("lolcats", "must be a mapping")):
        (tmp_path / "ck" / "config.json").write_text(json.dumps({**config, "linearize": record}))
        for load in (lambda: linearize.load(tmp_path / "ck", device="cpu"),
                     lambda: AutoModelForCausalLM.from_pretrained(tmp_path / "ck")):
            with pytest.raises(LinearizeError, match=match) as err:
                load()
            assert "\n" not in str(err.value)


@pytest.mark.slow
def test_lm_eval_cli_scores_the_linear_model_like_linearize_eval(tmp_path, capsys):
    """lm-eval's own command line (``--model hf``, ``trust_remote_code=True``, the suite's tasks as
    YAML) on a converted checkpoint of the real teacher gives ``linearize eval``'s PIQA score, and
    scores the student (its parameter count: the teacher's plus the feature maps), not the teacher."""
    pytest.importorskip("lm_eval")
    from linearize.cli import main
    from linearize.eval.tasks import export

    limit = "8"
    # a window shorter than the prompts, so that the linear attention counts (the model is not the teacher)
    assert main(["convert", "--out", str(tmp_path / "ck"), "--window", "8", "--device", "cpu"]) == 0
    export.write_task_yamls(tmp_path / "tasks", "piqa")
    assert main(["eval", str(tmp_path / "ck"), "--tasks", "piqa", "--limit", limit, "--no-perplexity", "--batch-size",
                 "4", "--device", "cpu", "--quiet", "--out", str(tmp_path / "ours.json")]) == 0
    capsys.readouterr()
    ours = json.loads((tmp_path / "ours.json").read_text())
    lm_eval = Path(sys.executable).with_name("lm_eval")
    done = subprocess.run([str(lm_eval), "--model", "hf", "--model_args",
                           f"pretrained={tmp_path / 'ck'},trust_remote_code=True,dtype=float32",
                           "--include_path", str(tmp_path / "tasks"), "--tasks", "piqa", "--limit", limit,
                           "--batch_size", "4", "--device", "cpu", "--output_path", str(tmp_path / "theirs")],
                          capture_output=True, text=True, env=_env(tmp_path), timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(next((tmp_path / "theirs").rglob("results_*.json")).read_text())
    assert theirs["config"]["model_num_parameters"] == ours["model"]["parameters"]
    mine, scores = ours["tasks"]["piqa"], theirs["results"]["piqa"]
    print(f"PIQA over {limit} docs: linearize eval acc {mine['metrics']['acc']} acc_norm {mine['metrics']['acc_norm']}; "
          f"lm_eval --model hf acc {scores['acc,none']} acc_norm {scores['acc_norm,none']}")
    assert mine["documents"] == int(limit) == theirs["n-samples"]["piqa"]["effective"]
    assert scores["acc,none"] == mine["metrics"]["acc"] and scores["acc_norm,none"] == mine["metrics"]["acc_norm"]

def test_students_pickle_by_class_name(tiny_model):
    import pickle

    student = _student(tiny_model, "llama", {"kind": "lolcats", "window": 4})
    copy = pickle.loads(pickle.dumps(student))
    assert type(copy) is type(student) and type(copy.config) is type(student.config)
    with torch.no_grad():
        assert torch.equal(copy(_ids()).logits, student(_ids()).logits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_automodel_on_cuda_in_bf16_matches_linearize_load(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from linearize.fast import fast_generate

    student = _student(tiny_model, "llama", {"kind": "supra"})
    linearize.save(student, tiny_tokenizer(), tmp_path / "ck")
    loaded, _ = linearize.load(tmp_path / "ck", dtype=torch.bfloat16, device="cuda")
    ids = _ids().cuda()
    for kwargs in ({"device_map": "cuda"}, {}):
        auto = AutoModelForCausalLM.from_pretrained(tmp_path / "ck", dtype=torch.bfloat16, **kwargs).cuda()
        assert all(m.log_decay.is_cuda and m.log_decay.dtype == torch.float32 for m in linearize.mixers(auto).values())
        with torch.no_grad():
            assert torch.equal(auto(ids).logits, loaded(ids).logits)
        want = fast_generate(loaded, ids[:1, :6], max_new_tokens=24, pad_token_id=0)
        assert torch.equal(fast_generate(auto, ids[:1, :6], max_new_tokens=24, pad_token_id=0), want)
