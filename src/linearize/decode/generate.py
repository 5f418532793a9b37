"""The fast decoder's entry points: ``fast_generate(model, input_ids, ...)``; ``decode``, the loop
behind ``model.generate(..., custom_generate=decode)``; and ``run_prepared``, what ``decode`` and
``generate()``'s default route (``decode.route``) share: the fast decoder on what ``generate()`` prepared."""

from __future__ import annotations

import torch

from ..errors import LinearizeError
from .loop import FastDecoder, as_list
from .sampling import Sampling


def fast_generate(model, input_ids, attention_mask=None, *, max_new_tokens: int = 32, do_sample: bool = False,
                  temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                  eos_token_id=None, pad_token_id=None, streamer=None, cuda_graph: bool | None = None,
                  compile: bool = False, prefill_batch: int | None = None,
                  fuse_projections: bool = True, fuse_kernels: bool | None = None) -> torch.Tensor:
    """Generate with the fast path; returns ``[B, T + n]`` ids like ``generate()``.

    Defaults for ``eos_token_id`` / ``pad_token_id`` come from the model's generation config.
    """
    gen = getattr(model, "generation_config", None)
    if eos_token_id is None and gen is not None:
        eos_token_id = gen.eos_token_id
    if pad_token_id is None and gen is not None:
        pad_token_id = gen.pad_token_id
    sampling = Sampling(do_sample, temperature, top_k, top_p)
    decoder = FastDecoder(model, cuda_graph=cuda_graph, compile=compile, prefill_batch=prefill_batch,
                          fuse_projections=fuse_projections, fuse_kernels=fuse_kernels)
    return decoder.generate(
        input_ids, attention_mask, max_new_tokens=max_new_tokens, sampling=sampling,
        eos_token_id=eos_token_id, pad_token_id=pad_token_id, streamer=streamer)


# generation settings the fast loop does not implement, with the value that means "off"
UNSUPPORTED = {"num_beams": 1, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_new_tokens": None,
               "min_length": 0, "num_return_sequences": 1, "min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0,
               "eta_cutoff": 0.0, "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None,
               "forced_bos_token_id": None, "forced_eos_token_id": None, "sequence_bias": None,
               "guidance_scale": None, "encoder_repetition_penalty": 1.0, "exponential_decay_length_penalty": None}


def settings_in_use(generation_config, names=UNSUPPORTED) -> list[str]:
    """``name=value`` for each of ``names`` (settings the fast loop does not implement) that
    ``generation_config`` sets to something other than its "off" value."""
    found = []
    for name in names:
        value = getattr(generation_config, name, UNSUPPORTED[name])
        if value is not None and value != UNSUPPORTED[name]:
            found.append(f"{name}={value!r}")
    return found


def _warpers():
    """The logits processors the fast decoder applies itself, in the order it applies them (the order in
    which ``generate()`` lists them): temperature, top-k, top-p."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    return TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper


def unhonoured_processors(logits_processor, generation_config) -> str | None:
    """Why the fast decoder cannot apply ``generate()``'s prepared ``logits_processor`` list (one clause,
    naming the settings behind it where they are ``UNSUPPORTED``'s, else the processors' classes), or None:
    each processor must be one of ``_warpers()``, each at most once, in that order, keeping one token
    at least (``min_tokens_to_keep`` 1)."""
    order = _warpers()
    kinds = [type(p) for p in logits_processor or ()]
    odd = [p for p in logits_processor or () if type(p) not in order or getattr(p, "min_tokens_to_keep", 1) != 1]
    if not odd and kinds == sorted(kinds, key=order.index) and len(set(kinds)) == len(kinds):
        return None
    named = settings_in_use(generation_config, [n for n in UNSUPPORTED if n != "num_return_sequences"])
    if named:
        return ", ".join(named)
    return "logits processors " + ", ".join(type(p).__name__ for p in (odd or logits_processor))


def sampling_of(logits_processor, generation_config) -> Sampling:
    """The fast decoder's ``Sampling`` for a prepared ``generate()`` call: greedy, or sampling with the
    temperature, top-k and top-p of the warpers ``generate()`` made (``unhonoured_processors`` passed)."""
    if not generation_config.do_sample:
        return Sampling()
    temperature, top_k, top_p = _warpers()
    found = {type(p): p for p in logits_processor or ()}
    return Sampling(True, found[temperature].temperature if temperature in found else 1.0,
                    found[top_k].top_k if top_k in found else None, found[top_p].top_p if top_p in found else None)


def own_criteria(stopping_criteria, generation_config):
    """The stopping criteria of a prepared ``generate()`` call that the fast decoder must call on the host
    (``FastDecoder.generate(stopping_criteria=...)``), or None: all but the maximum length and the EOS
    ids the decoder applies itself (stop strings, a time limit, lm-eval's stop sequences ... stay)."""
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

    eos = set(as_list(generation_config.eos_token_id))
    rest = [c for c in stopping_criteria or ()
            if not (isinstance(c, MaxLengthCriteria) and c.max_length >= generation_config.max_length)
            and not (isinstance(c, EosTokenCriteria) and set(as_list(c.eos_token_id)) <= eos)]
    return StoppingCriteriaList(rest) if rest else None


def run_prepared(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer=None,
                 model_kwargs=None) -> torch.Tensor:
    """The fast decoder on the inputs and settings ``generate()`` prepared for a decoding loop: the new
    tokens up to ``generation_config.max_length``, greedy or sampled as its warpers say, ending at its EOS
    ids and stopping criteria, padded with its pad id (``[B, T + n]`` ids, what ``generate()`` returns)."""
    cfg = generation_config
    return FastDecoder(model).generate(
        input_ids, (model_kwargs or {}).get("attention_mask"), max_new_tokens=cfg.max_length - input_ids.shape[1],
        sampling=sampling_of(logits_processor, cfg), eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
        streamer=streamer, stopping_criteria=own_criteria(stopping_criteria, cfg))


def decode(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
           synced_gpus=False, streamer=None, **model_kwargs):
    """The decoding loop for ``model.generate(..., custom_generate=decode)``.

    ``generate()`` prepares the inputs and the generation config (``max_new_tokens``, ``do_sample``,
    ``temperature``, ``top_k``, ``top_p``, EOS/pad ids, stopping criteria); this runs the fast path on
    them. Settings the fast path does not implement (beams, repetition penalties, ...) fail with one
    line. ``generate()`` hands a custom loop no streamer (it only shows it the prompt): to stream, call
    plain ``generate()`` (a linearize model's default route, ``decode.route``) or ``fast_generate(...,
    streamer=...)``.
    """
    cfg = generation_config
    why = ", ".join(settings_in_use(cfg)) or unhonoured_processors(logits_processor, cfg)
    if why:
        raise LinearizeError(f"fast decoding does not support {why}; use plain generate()")
    return run_prepared(model, input_ids, logits_processor, stopping_criteria, cfg, streamer, model_kwargs)
