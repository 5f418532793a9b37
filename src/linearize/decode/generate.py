"""The fast decoder's entry points: ``fast_generate(model, input_ids, ...)`` and ``decode``, the loop
behind ``model.generate(..., custom_generate=decode)``."""

from __future__ import annotations

import torch

from ..errors import LinearizeError
from .loop import FastDecoder
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


def decode(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
           synced_gpus=False, streamer=None, **model_kwargs):
    """The decoding loop for ``model.generate(..., custom_generate=decode)``.

    ``generate()`` prepares the inputs and the generation config (``max_new_tokens``, ``do_sample``,
    ``temperature``, ``top_k``, ``top_p``, EOS/pad ids); this runs the fast path on them. Settings the
    fast path does not implement (beams, repetition penalties, ...) fail with one line.
    ``generate()`` hands a custom loop no streamer (it only shows it the prompt): to stream, call
    ``fast_generate(..., streamer=...)``.
    """
    cfg = generation_config
    for name, neutral in UNSUPPORTED.items():
        value = getattr(cfg, name, neutral)
        if value is not None and value != neutral:
            raise LinearizeError(f"fast decoding does not support {name}={value!r}; use plain generate()")
    new = cfg.max_length - input_ids.shape[1]
    sampling = Sampling(bool(cfg.do_sample), cfg.temperature or 1.0, cfg.top_k or None,
                        cfg.top_p if cfg.top_p is not None and cfg.top_p < 1 else None) if cfg.do_sample else Sampling()
    return FastDecoder(model).generate(
        input_ids, model_kwargs.get("attention_mask"), max_new_tokens=new, sampling=sampling,
        eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id, streamer=streamer)
