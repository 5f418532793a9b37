"""``generate()`` on a linearize model takes the fast decoder by default (``linearize.decode.route``): for
every mixer kind and each way a checkpoint loads (``linearize.load``, ``AutoModelForCausalLM`` after
``import linearize``, ``trust_remote_code=True`` without it) it runs the fast decoder (seen through a spy
on ``FastDecoder.generate``, the entry every fast path shares: on the CPU both loops take the same time)
and gives the tokens of transformers' own loop, with and without left padding; sampling, EOS ids,
stopping criteria, stop strings and streamers stay on it; a pipeline and lm-eval's ``generate_until``
reach it; what it cannot honour runs transformers' loop with one line saying why; ``fast_decoding=False``
asks for that loop silently."""

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import linearize
from helpers import CollectStreamer, plain_generate, tiny_tokenizer
from linearize.decode import loop, route
from linearize.convert.xatl_transfer import build_xatl

SRC = Path(__file__).resolve().parents[2] / "src"
KINDS = {  # every mixer kind, a kept softmax layer beside lolcats, and the default's window-softmax layer
    "lolcats": {"kind": "lolcats", "window": 4, "feature_dim": 8},
    "lolcats+softmax": {"kind": "lolcats", "window": 4, "feature_dim": 8, "keep_softmax": [1]},
    "lolcats+window": {"kind": "lolcats", "window": 4, "feature_dim": 8, "feature_rope": False, "decay": "gated",
                       "keep_softmax": [1], "softmax_window": 6},
    "linear": {"kind": "linear", "feature_map": "hedgehog", "feature_dim": 8},
    "supra": {"kind": "supra"},
    "delta": {"kind": "delta", "window": 4, "chunk_size": 8},
    "retnet": "xatl:retnet",
    "striped_mamba": "xatl:striped_mamba",
}
NEW = 10


def _student(tiny_model, spec):
    teacher = tiny_model("llama", dtype=torch.float64)
    if isinstance(spec, str):
        return build_xatl(teacher, spec.removeprefix("xatl:"), seed=0)[0]
    return linearize.convert(teacher, spec)


def _ids(b=2, t=9, seed=0):
    return torch.randint(2, 97, (b, t), generator=torch.Generator().manual_seed(seed))


def _padded():
    """Three prompts of 9, 4 and 6 tokens, left-padded with the pad id 0, and their mask."""
    prompts = [_ids(1, n, seed=n)[0] for n in (9, 4, 6)]
    ids = torch.zeros(3, 9, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, 9 - len(p):], mask[i, 9 - len(p):] = p, 1
    return ids, mask


@pytest.fixture
def spy(monkeypatch):
    """Counts the fast decoder's runs (``FastDecoder.generate``) and forgets the fallback lines noted so far."""
    runs = []
    real = loop.FastDecoder.generate
    monkeypatch.setattr(loop.FastDecoder, "generate", lambda self, *a, **k: runs.append(1) or real(self, *a, **k))
    monkeypatch.setattr(route, "_noted", set())
    return runs


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A saved tiny student of each kind (float64, the tiny config's EOS id kept)."""
    from transformers import AutoModelForCausalLM

    from helpers import tiny_config

    root = tmp_path_factory.mktemp("route")

    def tiny_model(family="llama", dtype=torch.float32, **overrides):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(tiny_config(family, **overrides)).to(dtype).eval()

    for name, spec in KINDS.items():
        linearize.save(_student(tiny_model, spec), tiny_tokenizer(), root / name)
    return root


def _same_tokens_and_fast(model, spy, name):
    """Plain ``generate()`` runs the fast decoder once per call and gives transformers' loop's ids, on equal
    prompts without a mask and on left-padded ones with it."""
    ids, mask = _padded()
    for kwargs in ({"inputs": _ids()}, {"inputs": ids, "attention_mask": mask}):
        before = len(spy)
        routed = model.generate(**kwargs, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        assert len(spy) == before + 1, name
        plain = plain_generate(model, **kwargs, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        assert len(spy) == before + 1, name  # fast_decoding=False: transformers' loop
        assert torch.equal(routed, plain), (name, kwargs.keys())


@pytest.mark.parametrize("name", list(KINDS))
def test_every_kind_loaded_each_way_decodes_fast_with_the_plain_loops_tokens(name, checkpoints, spy):
    from transformers import AutoModelForCausalLM

    loaded, _ = linearize.load(checkpoints / name, device="cpu")
    auto = AutoModelForCausalLM.from_pretrained(checkpoints / name)
    # the gated decay's bias is float32 by design (``mixers/lolcats.py``); everything else keeps the saved float64
    assert type(auto) is type(loaded)
    assert {p.dtype for n, p in auto.named_parameters() if not n.endswith("gate_bias")} == {torch.float64}
    for model in (loaded, auto):
        _same_tokens_and_fast(model, spy, name)


def test_trust_remote_code_decodes_fast_without_importing_linearize(checkpoints, tmp_path):
    """``trust_remote_code=True`` in a process that never imports linearize itself: the same."""
    ids, mask = _padded()
    torch.save({"plain": _ids(), "ids": ids, "mask": mask}, tmp_path / "prompts.pt")
    code = f"""
        import json, sys
        import torch
        from transformers import AutoModelForCausalLM

        assert "linearize" not in sys.modules
        prompts = torch.load({str(tmp_path / 'prompts.pt')!r})
        results = {{}}
        for name in {list(KINDS)!r}:
            model = AutoModelForCausalLM.from_pretrained({str(checkpoints)!r} + "/" + name, trust_remote_code=True)
            from linearize.decode import loop

            runs, real = [], loop.FastDecoder.generate
            loop.FastDecoder.generate = lambda self, *a, **k: runs.append(1) or real(self, *a, **k)
            same = []
            padded = {{"inputs": prompts["ids"], "attention_mask": prompts["mask"]}}
            for kwargs in ({{"inputs": prompts["plain"]}}, padded):
                routed = model.generate(**kwargs, max_new_tokens={NEW}, do_sample=False, pad_token_id=0)
                plain = model.generate(**kwargs, max_new_tokens={NEW}, do_sample=False, pad_token_id=0,
                                       fast_decoding=False)
                same.append(torch.equal(routed, plain))
            loop.FastDecoder.generate = real
            results[name] = {{"module": type(model).__module__, "same": same, "fast_runs": len(runs)}}
        print(json.dumps(results))
    """
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"),
           "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          stdin=subprocess.DEVNULL, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for name in KINDS:
        assert results[name] == {"module": "linearize.hf", "same": [True, True], "fast_runs": 2}, name


# --------------------------------------------------------------------------- what stays on the fast decoder


def _lolcats(tiny_model, **generation):
    model = _student(tiny_model, KINDS["lolcats"])
    model.generation_config.eos_token_id = None
    for key, value in generation.items():
        setattr(model.generation_config, key, value)
    return model


def test_eos_ids_end_each_sequence_where_the_plain_loop_does(tiny_model, spy):
    """Several EOS ids, sequences ending at different steps, a pad id other than 0, and every sequence
    ending at the prefill's token: the ids end where transformers' loop ends them."""
    model = _lolcats(tiny_model)
    prompt = _ids(b=3, t=6, seed=5)
    free = plain_generate(model, prompt, max_new_tokens=20, pad_token_id=0)
    eos = sorted({int(free[0, 6 + 2]), int(free[1, 6 + 5]), int(free[2, 6 + 12])})
    firsts = sorted({int(t) for t in free[:, 6]})
    for kwargs in ({"eos_token_id": eos, "pad_token_id": 1}, {"eos_token_id": eos[0], "pad_token_id": 0},
                   {"eos_token_id": firsts, "pad_token_id": 0}):
        routed = model.generate(prompt, max_new_tokens=20, **kwargs)
        plain = plain_generate(model, prompt, max_new_tokens=20, **kwargs)
        assert routed.shape == plain.shape and torch.equal(routed, plain), kwargs
    assert plain.shape[1] == 6 + 1 and len(spy) == 3


def test_sampling_stays_fast(tiny_model, spy):
    model = _lolcats(tiny_model)
    prompt = _ids(b=2, t=7)
    greedy = plain_generate(model, prompt, max_new_tokens=9, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, max_new_tokens=9, do_sample=True, top_k=1, pad_token_id=0), greedy)
    torch.manual_seed(0)
    drawn = model.generate(prompt, max_new_tokens=9, do_sample=True, temperature=0.7, top_p=0.9,
                           num_return_sequences=2, pad_token_id=0)
    assert drawn.shape == (4, 16) and len(spy) == 2


class StopAt:
    """A stopping criterion of the caller's: sequence i ends once it holds ``tokens[i]`` after the prompt."""

    def __init__(self, tokens: torch.Tensor, prompt_len: int):
        self.tokens, self.prompt_len, self.calls = tokens, prompt_len, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        return (input_ids[:, self.prompt_len:] == self.tokens[:, None]).any(dim=1)


@pytest.mark.parametrize("eos", [None, 3])
def test_stopping_criteria_run_on_the_fast_decoder(tiny_model, spy, eos):
    """A criterion passed in, called after every token: without an EOS id a stopped sequence goes on
    until all have stopped, with one it is padded, as in transformers' loop."""
    from transformers import StoppingCriteriaList

    model = _lolcats(tiny_model)
    prompt = _ids(b=2, t=6, seed=5)
    free = plain_generate(model, prompt, max_new_tokens=20, pad_token_id=0)
    tokens = torch.stack([free[0, 6 + 3], free[1, 6 + 8]])  # sequence 0 stops at its 4th new token, 1 by its 9th
    outs = []
    for generate in (model.generate, lambda *a, **k: plain_generate(model, *a, **k)):
        criterion = StopAt(tokens, 6)
        outs.append(generate(prompt, max_new_tokens=20, pad_token_id=0, eos_token_id=eos,
                             stopping_criteria=StoppingCriteriaList([criterion])))
        assert criterion.calls == outs[-1].shape[1] - 6
    assert torch.equal(outs[0], outs[1]) and outs[0].shape[1] < 6 + 20 and len(spy) == 1


def _byte_tokenizer():
    """A byte-level BPE tokenizer over the tiny models' 97 ids (what stop strings need to read tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())[:97]
    tok = Tokenizer(models.BPE({s: i for i, s in enumerate(symbols)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=symbols[0], eos_token=symbols[1])


def test_stop_strings_and_streamers_run_on_the_fast_decoder(tiny_model, spy):
    model = _lolcats(tiny_model)
    prompt = _ids(b=1, t=6)
    tokenizer = _byte_tokenizer()
    free = plain_generate(model, prompt, max_new_tokens=20, pad_token_id=0)
    stop = tokenizer.decode(free[0, 6 + 5 : 6 + 7])
    routed = model.generate(prompt, max_new_tokens=20, stop_strings=[stop], tokenizer=tokenizer, pad_token_id=0)
    plain = plain_generate(model, prompt, max_new_tokens=20, stop_strings=[stop], tokenizer=tokenizer, pad_token_id=0)
    assert torch.equal(routed, plain) and routed.shape[1] <= 6 + 7 and len(spy) == 1


    seen = []
    for generate in (model.generate, lambda *a, **k: plain_generate(model, *a, **k)):
        streamer = CollectStreamer()
        out = generate(prompt, max_new_tokens=7, streamer=streamer, pad_token_id=0)
        assert streamer.ended and torch.equal(torch.cat(streamer.parts), out[0])
        seen.append([len(p) for p in streamer.parts])
    assert seen[0] == seen[1] == [6] + [1] * 7 and len(spy) == 2  # the prompt, then each token


def test_a_pipeline_and_lm_evals_generate_until_decode_fast(checkpoints, spy):
    from transformers import pipeline

    generator = pipeline("text-generation", model=str(checkpoints / "supra"), device="cpu")
    text = generator("w5 w6 w7 w8", max_new_tokens=6, do_sample=False, return_full_text=False)[0]["generated_text"]
    assert len(spy) == 1
    generator.model.generation_config.fast_decoding = False  # the switch for every call
    assert generator("w5 w6 w7 w8", max_new_tokens=6, do_sample=False,
                     return_full_text=False)[0]["generated_text"] == text
    assert len(spy) == 1

    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from linearize.eval import LinearizeLM

    model, tokenizer = linearize.load(checkpoints / "supra", device="cpu")
    requests = [Instance(request_type="generate_until", doc={}, idx=i,
                         arguments=(prompt, {"until": ["w1"], "max_gen_toks": 8, "do_sample": False}))
                for i, prompt in enumerate(["w5 w6 w7 w8", "w9 w10", "w3 w4 w5 w6 w7 w8 w9"])]
    alone = LinearizeLM(model, tokenizer, batch_size=1, progress=False).generate_until(requests)
    assert len(spy) == 4  # one call per request
    answers = LinearizeLM(model, tokenizer, batch_size=3, progress=False).generate_until(requests)
    assert len(spy) == 5 and answers == alone  # one left-padded batch: each request's tokens as alone
    model.generation_config.fast_decoding = False
    assert LinearizeLM(model, tokenizer, batch_size=3, progress=False).generate_until(requests) == answers
    assert len(spy) == 5


# --------------------------------------------------------------------------- what runs transformers' loop


@pytest.mark.parametrize("settings, named", [
    ({"num_beams": 2}, "num_beams=2"),
    ({"repetition_penalty": 1.3}, "repetition_penalty=1.3"),
    ({"no_repeat_ngram_size": 2}, "no_repeat_ngram_size=2"),
    ({"min_new_tokens": 4, "eos_token_id": 3}, "min_new_tokens=4"),
    ({"return_dict_in_generate": True}, "return_dict_in_generate=True"),
    ({"use_cache": False}, "use_cache=False"),
    ({"cache": "linearize"}, "a cache passed in"),
    ({"logits_processor": "suppress"}, "SuppressTokensLogitsProcessor"),
])
def test_what_the_fast_decoder_cannot_honour_runs_the_plain_loop_with_one_line(tiny_model, spy, caplog, settings,
                                                                               named):
    from transformers import LogitsProcessorList, SuppressTokensLogitsProcessor

    from linearize.cache import LinearizeCache

    model = _lolcats(tiny_model)
    prompt = _ids(b=2, t=7)

    def call(generate):
        made = {"cache": lambda: LinearizeCache(model),
                "logits_processor": lambda: LogitsProcessorList([SuppressTokensLogitsProcessor([5, 6])])}
        kwargs = {k: made[k]() if k in made else v for k, v in settings.items()}
        return generate(prompt, max_new_tokens=6, pad_token_id=0, **kwargs)

    with caplog.at_level(logging.WARNING, logger="linearize"):
        routed = call(model.generate)
        again = call(model.generate)  # the same reason again: no second line
    plain = call(lambda *a, **k: plain_generate(model, *a, **k))
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("linearize")]
    assert len(lines) == 1 and named in lines[0] and "fast_decoding=False" in lines[0], lines
    assert len(spy) == 0
    if settings.get("return_dict_in_generate"):
        routed, again, plain = routed.sequences, again.sequences, plain.sequences
    assert torch.equal(routed, plain) and torch.equal(again, plain)


def test_fast_decoding_false_and_a_custom_loop_take_the_plain_loop_silently(tiny_model, spy, caplog):
    from transformers import GenerationConfig

    from linearize.fast import decode

    model = _lolcats(tiny_model)
    prompt = _ids(b=2, t=7)
    with caplog.at_level(logging.WARNING, logger="linearize"):
        ref = model.generate(prompt, max_new_tokens=6, pad_token_id=0, fast_decoding=False)
        config = GenerationConfig(max_new_tokens=6, pad_token_id=0, fast_decoding=False)
        assert torch.equal(model.generate(prompt, config), ref)  # on a config passed in, by position too
        model.generation_config.fast_decoding = False
        assert torch.equal(model.generate(prompt, max_new_tokens=6, pad_token_id=0), ref)
        assert len(spy) == 0
        # the keyword wins over the config; custom_generate=decode asks for the fast loop outright
        assert torch.equal(model.generate(prompt, max_new_tokens=6, pad_token_id=0, fast_decoding=True), ref)
        assert torch.equal(model.generate(prompt, max_new_tokens=6, pad_token_id=0, custom_generate=decode), ref)
    assert len(spy) == 2 and not [r for r in caplog.records if r.name.startswith("linearize")]
    assert route.plain_loop(model) == {"fast_decoding": False}
    assert route.plain_loop(tiny_model("llama")) == {}  # a softmax model's generate() takes no such keyword
