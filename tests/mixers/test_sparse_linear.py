"""``spec.sparse_linear``: the linear terms' weight beside a sparse cache (issue #46's recall). With
weight 0 the last query attends by softmax to its window and the cache alone; the mixer scales the
query features it hands every form, so a student decodes through the cache as its forward computes
and the fast decoder as generate(); weight 1 is the student as trained; the flag needs a cache and a
value in [0, 1], each refused in one line."""

import json

import pytest
import torch

import linearize
from helpers import decode_incrementally, gated_student, left_padded, plain_generate, tiny_student, tiny_tokenizer
from linearize import LinearizeError, ops
from linearize.convert import mixers
from linearize.fast import fast_generate

LONG = {"kind": "lolcats", "window": 4, "feature_dim": 8, "feature_rope": False, "decay": "gated", "decay_horizon": 8}


@pytest.mark.parametrize("priority,anchor", [("recall", "joint"), ("novelty", "window"), ("first", "joint")])
def test_weight_zero_leaves_the_window_and_the_cache_alone(priority, anchor):
    """With no linear terms each query's output is plain softmax attention over its window and the
    tokens cached at its step: checked for the last query against the final state's cache, in the
    chunked and the recurrent forms."""
    g = torch.Generator().manual_seed(1)
    b, h, hk, t, w, cap = 2, 4, 2, 23, 3, 4
    q, k, v = (torch.randn(b, n, t, 4, generator=g, dtype=torch.float64) for n in (h, hk, hk))
    qf = torch.zeros(b, h, t, 6, dtype=torch.float64)
    kf = torch.randn(b, hk, t, 6, generator=g, dtype=torch.float64).exp()
    gamma = torch.tensor([0.2, 0.4, 0.6, 0.8], dtype=torch.float64)
    kw = dict(window=w, cache_size=cap, scale=0.5, priority=priority, anchor=anchor)
    # (the recurrent form always returns its final state, the chunked one when asked)
    for form, extra in ((ops.sparse_hybrid_attention_chunked, {"output_final_state": True}),
                        (ops.sparse_hybrid_attention_recurrent, {})):
        y, state = form(q, k, qf, kf, v, gamma, **kw, **extra)
        for i in range(b):
            for head in range(h):
                kh = head // (h // hk)
                seen = set(range(t - w, t)) | set(state.cache_pos[i, kh][state.cache_valid[i, kh]].tolist())
                assert len(seen) == w + cap  # the cache is full: tokens were folded too
                idx = torch.tensor(sorted(seen))
                p = torch.softmax(k[i, kh, idx] @ q[i, head, -1] * 0.5, dim=0)
                torch.testing.assert_close(y[i, head, -1], p @ v[i, kh, idx], atol=1e-12, rtol=0)


def test_the_mixer_scales_the_query_features_it_hands_the_op(tiny_model, monkeypatch):
    student = gated_student(tiny_model, {**LONG, "sparse_cache": 3})
    ids = torch.randint(2, 97, (1, 19), generator=torch.Generator().manual_seed(0))
    seen = []  # the query features each layer's sparse op receives
    real = ops.sparse_hybrid_attention_chunked
    monkeypatch.setattr(ops, "sparse_hybrid_attention_chunked",
                        lambda q, k, qf, *a, **kw: seen.append(qf) or real(q, k, qf, *a, **kw))
    student(ids, use_cache=False)
    full = seen[0]  # the first layer's: its inputs do not depend on the weight
    linearize.respec(student, sparse_linear=0.25)
    student(ids, use_cache=False)
    torch.testing.assert_close(seen[len(seen) // 2], 0.25 * full, atol=1e-15, rtol=0)
    monkeypatch.undo()
    as_trained = student(ids, use_cache=False).logits
    linearize.respec(student, sparse_linear=1.0)
    assert (student(ids, use_cache=False).logits - as_trained).abs().max() > 1e-4


@pytest.mark.parametrize("spec", [LONG, {"kind": "lolcats", "window": 3, "feature_dim": 8}])
@pytest.mark.parametrize("priority", ["novelty", "first"])
def test_a_weighted_student_decodes_through_the_cache_as_its_forward(tiny_model, spec, priority):
    student = gated_student(tiny_model, {**spec, "sparse_cache": 4, "sparse_priority": priority,
                                         "sparse_linear": 0.3})
    ids = torch.randint(2, 97, (2, 29), generator=torch.Generator().manual_seed(0))
    full = student(ids, use_cache=False).logits
    torch.testing.assert_close(decode_incrementally(student, ids, 13), full, atol=1e-10, rtol=0)


@pytest.mark.parametrize("weight", [0.0, 0.5])
def test_fast_decoder_equals_generate_with_a_weighted_cache(tiny_model, weight):
    student = tiny_student(tiny_model, "llama", {**LONG, "window": 3, "sparse_cache": 2, "sparse_priority": "novelty",
                                                 "sparse_linear": weight})
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 97, (n,), generator=g) for n in (9, 4)]
    ids, mask = left_padded(prompts)
    batch = fast_generate(student, ids, mask, max_new_tokens=16, pad_token_id=0)
    for i, p in enumerate(prompts):
        ref = plain_generate(student, p[None], max_new_tokens=16, do_sample=False, pad_token_id=0)
        assert torch.equal(batch[i, ids.shape[1]:], ref[0, len(p):]), i


def test_bad_weights_fail_with_one_line(tiny_model):
    for bad in (-0.1, 1.5, "half", True):
        with pytest.raises(LinearizeError, match="sparse_linear") as err:
            linearize.convert(tiny_model("llama"), {"kind": "lolcats", "sparse_cache": 4, "sparse_linear": bad})
        assert "\n" not in str(err.value)
    assert linearize.spec_of(linearize.convert(tiny_model("llama"), {"kind": "lolcats", "sparse_linear": 0})
                             ).sparse_linear == 0.0


def test_the_flag_needs_a_cache_and_a_weight_in_range(tmp_path, capsys):
    from linearize.cli import _spec_from_args, build_parser, main

    argv = ["convert", "--teacher", str(tmp_path / "absent"), "--out", str(tmp_path / "out"), "--sparse-linear", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--sparse-linear" in err and "--sparse-cache" in err and err.count("\n") == 1, err
    assert main(argv + ["--sparse-cache", "8", "--sparse-linear", "2"]) == 2
    err = capsys.readouterr().err
    assert "--sparse-linear" in err and "[0, 1]" in err and err.count("\n") == 1, err
    args = build_parser().parse_args(["convert", "--out", str(tmp_path / "out"), "--sparse-cache", "8",
                                      "--sparse-linear", "0"])
    spec, _ = _spec_from_args(args)
    assert (spec["sparse_cache"], spec["sparse_linear"]) == (8, 0.0)


def test_eval_takes_the_weight_without_training(tmp_path, monkeypatch, tiny_model, capsys):
    """`linearize eval CK --sparse-cache S --sparse-linear W` scores the checkpoint so and records W;
    without a cache the weight is refused in one line."""
    from linearize.cli import main

    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i % 77 + 20}" for i in range(400)))
    linearize.save(linearize.convert(tiny_model("llama"), {"kind": "lolcats", "window": 4}), tiny_tokenizer(),
                   tmp_path / "ck")
    ppl = {}
    for weight in ("1", "0"):
        out = tmp_path / f"w{weight}.json"
        assert main(["eval", str(tmp_path / "ck"), "--source", str(text), "--block-len", "64", "--device", "cpu",
                     "--quiet", "--sparse-cache", "8", "--sparse-linear", weight, "--out", str(out)]) == 0
        record = json.loads(out.read_text())
        assert record["model"]["spec"]["sparse_linear"] == float(weight)
        ppl[weight] = record["perplexity"]["value"]
    assert ppl["0"] != ppl["1"]
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "ck"), "--source", str(text), "--device", "cpu", "--quiet",
                 "--sparse-linear", "0"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("linearize: error: --sparse-linear"), errors
    assert all(m.spec.sparse_linear == 1.0 for m in mixers(linearize.load(tmp_path / "ck", device="cpu")[0]).values())
