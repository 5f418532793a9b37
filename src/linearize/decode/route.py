"""``generate()`` on a linearize model runs the fast decoder whenever it can honour the call.

Every ``linearize_<base>`` model class (``linearize.hf``) hands its ``generate`` calls to ``generate``
here, however the model was loaded (``linearize.load``, ``AutoModelForCausalLM`` after ``import
linearize``, ``trust_remote_code=True``), so ``pipeline("text-generation")`` and lm-eval's
``generate_until`` take the fast decoder too. The call goes through transformers' own ``generate()``
either way, which prepares the inputs, the generation config, the logits processors and the stopping
criteria; only the decoding loop differs (the fast one enters through ``custom_generate``):

- **fast** (``route``): greedy or sampling (temperature, top-k, top-p), any number of return
  sequences, EOS ids, stopping criteria (stop strings, a time limit, lm-eval's stop sequences: called
  on the host after every token, as ``generate()`` calls them), streamers. It returns what
  ``generate()`` returns for such a call, the ``[B, T + n]`` ids, ending where the last sequence ended.
  Sampled tokens follow the same distribution as the plain loop's, not the same draws for a seed.
- **transformers' loop**, with one warning line saying why (once per reason and process): beams,
  assisted decoding and the other generation modes; a logits processor other than those three
  (repetition penalty, ``no_repeat_ngram_size``, a minimum length with an EOS id, bad words, a
  processor passed in ...); ``return_dict_in_generate=True`` (the fast decoder keeps no cache,
  scores or hidden states to return); a cache passed in (``generate()`` fills the one given);
  ``inputs_embeds``; ``use_cache=False``; a ``cache_implementation``; GPUs synced across processes;
  a model the fast decoder cannot run (``loop.unsupported_model``, or the decoder's own refusal).
- **transformers' loop, silently**: ``fast_decoding=False`` (``generate(..., fast_decoding=False)``,
  or ``fast_decoding`` set to False on the generation config passed in or on the model's
  ``generation_config``, which ``save_pretrained`` keeps), or a ``custom_generate`` of the caller's.
"""

from __future__ import annotations

import copy
import inspect
import logging

from ..errors import LinearizeError
from .generate import run_prepared, unhonoured_processors
from .loop import unsupported_model

logger = logging.getLogger(__name__)

FLAG = "fast_decoding"  # generate(..., fast_decoding=False) / generation_config.fast_decoding = False: the plain loop
CACHES = ("cache", "past_key_values", "cache_params")  # a cache passed in, under each of its names
# what generate() passes a decoding loop besides the prompt's mask, none of which the fast decoder needs
PREPARED = {"attention_mask", "position_ids", "use_cache", "logits_to_keep", "cache_position", *CACHES}
_noted: set[str] = set()


def plain_loop(model) -> dict:
    """The ``generate()`` keywords that run transformers' own loop on ``model``: ``{"fast_decoding": False}``
    for a model whose ``generate`` takes the fast decoder by default (a linearize model class), ``{}`` for
    any other (whose ``generate()`` would refuse the keyword)."""
    try:
        takes = FLAG in inspect.signature(type(model).generate).parameters
    except (AttributeError, TypeError, ValueError):
        takes = False
    return {FLAG: False} if takes else {}


def note(why: str) -> None:
    """The one line saying why a call runs transformers' loop (once per reason in a process)."""
    if why not in _noted:
        _noted.add(why)
        logger.warning("linearize: generate() runs transformers' decoding loop, not the fast decoder, for %s; "
                       "generate(..., fast_decoding=False) asks for that loop without this line", why)


def generate(model, parent, fast_decoding: bool | None, *args, **kwargs):
    """``model.generate(*args, **kwargs)`` through ``parent`` (transformers' ``generate`` bound to the
    model), with the fast decoder as its loop unless ``fast_decoding`` (None: the generation config's
    ``fast_decoding``, else True) is False, the caller gave a ``custom_generate``, or ``before`` or
    ``unhonoured_settings`` find what the fast decoder cannot honour (then one line, ``note``)."""
    try:
        call = _keywords(parent, args, kwargs)
    except TypeError:  # generate() explains a call it cannot take
        return parent(*args, **kwargs)
    if fast_decoding is None:
        configs = (call.get("generation_config"), model.generation_config)
        fast_decoding = next((c.fast_decoding for c in configs if getattr(c, FLAG, None) is not None), True)
    if not fast_decoding or call.get("custom_generate") is not None:
        return parent(**call)
    why = before(model, call)
    cfg = settings(model, parent, call) if why is None else None
    why = why or unhonoured_settings(cfg, call.get("assistant_model"))
    if why is not None:
        note(why)
        return parent(**call)
    call.pop("custom_generate", None)
    # what generate() would keep from a custom loop, the loop gets under names of its own
    extra = {"linearize_streamer": call.pop("streamer", None)}
    if cfg.stop_strings is not None and call.get("tokenizer") is not None:
        extra["linearize_stop_strings"] = (call.pop("tokenizer"), cfg.stop_strings)
        given = call.get("generation_config")
        if "stop_strings" in call or given is None or given.stop_strings is None:
            call["stop_strings"] = None
        else:  # a keyword beside a config passed in would draw transformers' warning: a copy without them
            call["generation_config"] = copy.deepcopy(given)
            call["generation_config"].stop_strings = None
    return parent(**call, custom_generate=route, **extra)


def _keywords(parent, args, kwargs) -> dict:
    """The call's arguments as keywords of ``generate()`` (``inputs`` given by position, too)."""
    bound = inspect.signature(parent).bind(*args, **kwargs)
    call = dict(bound.arguments)
    call.update(call.pop("kwargs", {}))
    return call


def before(model, call: dict) -> str | None:
    """Why the fast decoder cannot take this call, as far as the model and the call's own arguments say
    (one clause), or None."""
    why = unsupported_model(model)
    if why is not None:
        return why
    if any(call.get(name) is not None for name in CACHES):
        return "a cache passed in (generate() fills the one given)"
    if call.get("inputs_embeds") is not None:
        return "inputs_embeds (the fast decoder starts from token ids)"
    if call.get("synced_gpus") or _synced(model):
        return "GPUs synced across processes (synced_gpus)"
    return None


def settings(model, parent, call: dict):
    """The call's generation config, as ``parent`` (``generate()``) makes it: the one passed in or the
    model's, updated with the keywords that are not ``generate()``'s own parameters."""
    own = set(inspect.signature(parent).parameters) | {"trust_remote_code", "tokenizer", "assistant_tokenizer"}
    cfg, _ = model._prepare_generation_config(call.get("generation_config"),
                                              **{k: v for k, v in call.items() if k not in own})
    return cfg


def unhonoured_settings(cfg, assistant_model=None) -> str | None:
    """Why the fast decoder cannot take a call with generation config ``cfg`` (one clause), or None: a
    generation mode other than greedy and sampling, or an output or cache it does not make."""
    from transformers.generation.configuration_utils import GenerationMode

    mode = cfg.get_generation_mode(assistant_model)
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return (f"num_beams={cfg.num_beams}, " if "beam" in mode.value else "") + mode.value.replace("_", " ")
    if cfg.return_dict_in_generate:
        return "return_dict_in_generate=True (the fast decoder returns the token ids alone)"
    if not cfg.use_cache:
        return "use_cache=False"
    if cfg.cache_implementation is not None:
        return f"cache_implementation={cfg.cache_implementation!r}"
    return None


def _synced(model) -> bool:
    """Whether ``generate()`` would sync GPUs across processes (DeepSpeed ZeRO-3 or FSDP over several)."""
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
        from transformers.integrations.fsdp import is_fsdp_managed_module
    except ImportError:
        return False
    import torch.distributed as dist

    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    return several and (is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model))


def route(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
          synced_gpus=False, streamer=None, linearize_streamer=None, linearize_stop_strings=None, **model_kwargs):
    """The decoding loop ``generate`` gives ``generate()`` (``custom_generate``): the fast decoder
    (``run_prepared``) where it applies every prepared logits processor and takes every model input,
    else, with one line, transformers' own loop on the same prepared call. ``generate()`` passes a
    custom loop neither the caller's streamer nor the tokenizer its stop strings need: they come as
    ``linearize_streamer`` and ``linearize_stop_strings`` ``(tokenizer, strings)``, whose criteria are
    made here as ``generate()`` makes them."""
    cfg = generation_config
    if linearize_stop_strings is not None:
        from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria

        tokenizer, strings = linearize_stop_strings
        stopping_criteria = StoppingCriteriaList([*(stopping_criteria or ()),
                                                  StopStringCriteria(tokenizer=tokenizer, stop_strings=strings)])
    odd = sorted(k for k, v in model_kwargs.items() if k not in PREPARED and v is not None)
    why = unhonoured_processors(logits_processor, cfg) or (f"model inputs {', '.join(odd)}" if odd else None)
    if why is None and cfg.max_length <= input_ids.shape[1]:
        why = f"no new tokens to generate (max_length {cfg.max_length}, prompt {input_ids.shape[1]} tokens)"
    if why is None:
        try:
            return run_prepared(model, input_ids, logits_processor, stopping_criteria, cfg, linearize_streamer,
                                model_kwargs)
        except LinearizeError as exc:  # a refusal the checks above did not foresee (the decoder refuses up front)
            why = str(exc)
    note(why)
    if linearize_streamer is not None:  # what generate() shows a streamer before its loop
        linearize_streamer.put(input_ids.cpu())
    return model._sample(input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                         generation_config=cfg, synced_gpus=synced_gpus, streamer=linearize_streamer, **model_kwargs)
