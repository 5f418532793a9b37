"""Fast constant-memory decoding: static state buffers, the whole decode step as one CUDA graph,
sampling on the device.

``generate()`` pays Python and kernel-launch overhead on every token (tens of milliseconds for a
30-layer model), while the GPU work of a recurrent step is well under a millisecond. The fast path
removes that overhead:

1. **Prefill** runs the model once over the (left-padded) prompt through the chunked forms, so a
   long prompt costs linear time.
2. The cache is then turned into **static buffers** of fixed shape: each converted layer's state
   (the LoLCATs window becomes a ring of exactly ``w`` slots, ``ops.RingHybridState``, or
   ``ops.FusedRingState`` where its fused CUDA kernel runs); each kept softmax layer gets a
   key/value buffer sized for the prompt plus every new token, with a mask.
3. **One decode step** — model forward on one token, sampling, writing the token, advancing the
   positions — touches only those buffers and reads nothing back to the host, so on CUDA it is
   captured once as a CUDA graph and replayed per token. On the CPU the same step runs eagerly.
4. During the call, each converted layer's q/k/v and each gated MLP's gate/up are **one matrix
   product** (``linearize.fused``, weights concatenated per call): fewer kernel launches per step.

Sampling (greedy, temperature, top-k, top-p) runs on the device; a draw from ``p`` is
``argmax(p / E)`` with ``E ~ Exp(1)`` (no host sync, graph-safe). Sequences that hit an EOS token
continue as padding; the host checks for "all done" every ``check_every`` steps.

Entry points: ``fast_generate(model, input_ids, ...)``, and ``model.generate(...,
custom_generate=linearize.fast.decode)`` which runs the usual ``generate()`` input preparation and
then this loop.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicCache

from . import ops
from .cache import LinearizeCache, RecurrentLayer, state_tensors
from .errors import LinearizeError
from .fused import fused_projections


# --- sampling --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Sampling:
    """How the next token is picked. ``do_sample=False`` is greedy (argmax)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if self.do_sample:
            if not self.temperature > 0:
                raise LinearizeError(f"temperature must be > 0 when sampling, got {self.temperature}")
            if self.top_k is not None and self.top_k < 1:
                raise LinearizeError(f"top_k must be a positive integer, got {self.top_k}")
            if self.top_p is not None and not 0 < self.top_p <= 1:
                raise LinearizeError(f"top_p must be in (0, 1], got {self.top_p}")


def filter_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """``[B, V]`` float logits after temperature, top-k and top-p (removed tokens at -inf)."""
    logits = logits / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p is not None and sampling.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked before it already reach top_p (the first always stays)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_tokens(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """``[B]`` next tokens from ``[B, V]`` logits, entirely on the device."""
    logits = logits.float()
    if not sampling.do_sample:
        return logits.argmax(dim=-1)
    probs = torch.softmax(filter_logits(logits, sampling), dim=-1)
    race = torch.empty_like(probs).exponential_(1.0)  # argmax(p / Exp(1)) is a draw from p
    return (probs / race).argmax(dim=-1)


# --- static cache ----------------------------------------------------------------------------------

class StaticStateLayer(RecurrentLayer):
    """A converted layer's state in fixed buffers; decode steps overwrite them in place."""

    static = True

    def __init__(self, state, position: torch.Tensor):
        super().__init__()
        self.state = state
        self.position = position  # 0-d long: tokens absorbed so far (shared by every layer)

    def store(self, state, n_tokens: int) -> None:
        # ``seen`` stays as the prefill left it: the count lives on the device (``position``), and a
        # Python counter would be frozen by a CUDA graph and recompile a compiled step every token
        if state is not self.state:  # an out-of-place step: copy into the buffers the graph reads
            for buf, new in zip(state_tensors(self.state), state_tensors(state)):
                buf.copy_(new)



class StaticKVLayer(CacheLayerMixin):
    """A kept softmax layer's keys and values, preallocated for the prompt plus every new token."""

    is_compileable = False
    is_sliding = False
    static = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, total: int, position: torch.Tensor):
        super().__init__()
        b, h, t, d = keys.shape
        self.keys = keys.new_zeros(b, h, total, d)
        self.values = values.new_zeros(b, h, total, values.shape[-1])
        self.keys[:, :, :t], self.values[:, :, :t] = keys, values
        self.position = position
        self.is_initialized = True

    def lazy_initialization(self, key_states=None, value_states=None) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        idx = self.position.view(1)
        self.keys.index_copy_(2, idx, key_states.to(self.keys.dtype))
        self.values.index_copy_(2, idx, value_states.to(self.values.dtype))
        return self.keys, self.values

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self, *args) -> int:
        return self.keys.shape[2]

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class StaticCache(DynamicCache):
    """The fast decoder's cache: every layer static, one shared device position."""

    def __init__(self, layers: list, config):
        super().__init__(config=config)
        self.layers[:] = layers


# --- the decoder -----------------------------------------------------------------------------------

def _positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch: each sequence counts from 0 at its first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def _check_supported(model) -> None:
    cfg = model.config
    kept = set(cfg.linearize["keep_softmax"]) if getattr(cfg, "linearize", None) else set(range(cfg.num_hidden_layers))
    types = getattr(cfg, "layer_types", None)
    sliding = {i for i in kept if types and types[i] == "sliding_attention"}
    if getattr(cfg, "sliding_window", None) and not types and kept:
        sliding = kept
    if sliding:
        raise LinearizeError(f"fast decoding does not handle sliding-window softmax layers ({sorted(sliding)}); "
                             "use model.generate() for this model")
    from .convert import mixers

    unsupported = sorted(i for i, m in mixers(model).items() if not m.fast_decodable())
    if unsupported:
        raise LinearizeError(f"fast decoding does not handle the state of layers {unsupported} (a sparse cache or a "
                             "delta-rule window); use model.generate() (linearize generate --decoder generate)")
    if getattr(cfg, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        raise LinearizeError(f"fast decoding needs the sdpa or eager attention, not {cfg._attn_implementation!r}")


class FastDecoder:
    """Decode a batch of prompts with fixed buffers and, on CUDA, one CUDA graph per step.

    ``cuda_graph``: None = on CUDA devices; False = run the step eagerly (the graph's twin).
    ``keep_key_features``: keep the LoLCATs window's key features in the state (more memory) instead
    of recomputing a key's features when it leaves the window (the default).
    ``compile``: compile the decode step with ``torch.compile`` (fewer, fused kernels; the first
    call pays the compilation). ``prefill_batch``: prefill that many prompts at a time (None: all).
    ``fuse_projections``: during each call, compute q/k/v with one matrix product per converted
    layer and a gated MLP's gate/up with one (``linearize.fused``: fewer kernel launches per step,
    the same function; weights concatenated afresh on every call, modules restored afterwards).
    After each call, ``timings`` holds the seconds of prefill, setup (state buffers, the first
    eager steps, graph capture) and decoding, the number of new tokens, the steps the decoding time
    covers and the bytes of the decoding state.
    """

    def __init__(self, model, *, cuda_graph: bool | None = None, keep_key_features: bool = False,
                 compile: bool = False, prefill_batch: int | None = None, fuse_projections: bool = True):
        _check_supported(model)
        self.model = model
        self.fuse_projections = fuse_projections
        self.prefill_batch = prefill_batch
        self.keep_key_features = keep_key_features
        # torch.compile fuses the step's many small kernels (feature maps, norms, window softmax);
        # the prefill stays eager (its shapes change with every prompt)
        self.step_forward = torch.compile(model.forward, dynamic=False) if compile else model.forward
        self.device = next(model.parameters()).device
        self.cuda_graph = self.device.type == "cuda" if cuda_graph is None else cuda_graph
        if self.cuda_graph and self.device.type != "cuda":
            raise LinearizeError("CUDA graphs need a CUDA device")

    # -- prefill ---------------------------------------------------------------------------------
    def _prefill(self, input_ids, attention_mask):
        """The prompts through the chunked forms, ``prefill_batch`` sequences at a time (a large
        batch's prefill activations would otherwise dwarf its decoding state); the pieces' states
        are joined layer by layer."""
        n = self.prefill_batch or input_ids.shape[0]
        logits, caches = [], []
        for s in range(0, input_ids.shape[0], n):
            cache = LinearizeCache(self.model)
            mask = attention_mask[s : s + n]
            out = self.model(input_ids[s : s + n], attention_mask=mask, position_ids=_positions(mask),
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
            logits.append(out.logits[:, -1])
            caches.append(cache)
        return torch.cat(logits), _join(caches)

    def _static_cache(self, cache, total: int, position: torch.Tensor) -> StaticCache:
        """The decoding buffers from the prefill's ``cache``, which is emptied layer by layer as its
        tensors are taken over or copied, so a large batch never holds both whole. (The prefill's
        states own their memory: ``cache.own_storage``; views of the prompt's activations once
        doubled a large batch's peak.)"""
        from .convert import mixers

        converted, layers = mixers(self.model), []
        for i, layer in enumerate(cache.layers):
            if isinstance(layer, RecurrentLayer):
                state, layer.state = layer.state, None
                if isinstance(state, ops.HybridState):
                    state = converted[i].ring_state(state, keep_key_features=self.keep_key_features)
                else:
                    state = state.contiguous()
                layers.append(StaticStateLayer(state, position))
            else:
                layers.append(StaticKVLayer(layer.keys, layer.values, total, position))
                layer.keys = layer.values = None
        return StaticCache(layers, self.model.config)

    # -- the loop --------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int = 32, sampling: Sampling = Sampling(), eos_token_id=None,
                 pad_token_id: int | None = None, streamer=None, check_every: int = 16) -> torch.Tensor:
        """``[B, T + n]`` token ids: the prompts followed by up to ``max_new_tokens`` new tokens.

        ``attention_mask`` marks real tokens of left-padded prompts (1) and padding (0). Sequences
        that produce an ``eos_token_id`` continue with ``pad_token_id``; decoding ends early once
        every sequence has (checked every ``check_every`` steps, or every step with a streamer).
        """
        if max_new_tokens < 1:
            raise LinearizeError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise LinearizeError("input_ids must be a non-empty [batch, length] tensor")
        # the fused weights live for this call only: a CUDA graph captured below replays within it
        with fused_projections(self.model, enabled=self.fuse_projections):
            return self._generate(input_ids, attention_mask, max_new_tokens, sampling, eos_token_id,
                                  pad_token_id, streamer, check_every)

    def _generate(self, input_ids, attention_mask, max_new_tokens, sampling, eos_token_id, pad_token_id,
                  streamer, check_every) -> torch.Tensor:
        dev = self.device
        input_ids = input_ids.to(dev)
        b, t = input_ids.shape
        attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(dev)
        eos = torch.tensor(sorted(_as_list(eos_token_id)) or [-1], device=dev)
        pad = pad_token_id if pad_token_id is not None else (_as_list(eos_token_id) or [0])[0]

        clock = _Clock(dev)
        logits, cache = self._prefill(input_ids, attention_mask)
        clock.lap("prefill_s")
        total = t + max_new_tokens
        position = torch.tensor(t, device=dev)  # 0-d: tokens absorbed (padding included)
        static = self._static_cache(cache, total, position)
        del cache
        clock.lap("cache_s")

        # the step's inputs and outputs: fixed tensors the graph reads and writes
        token = next_tokens(logits, sampling)[:, None]
        finished = torch.isin(token[:, 0], eos)
        out = torch.full((b, max_new_tokens), pad, dtype=torch.long, device=dev)
        out[:, 0] = token[:, 0]
        step_index = torch.ones((), dtype=torch.long, device=dev)
        position_ids = _positions(attention_mask)[:, -1:] + 1
        # kept softmax layers read a [B, 1, 1, total] additive mask (padding and unwritten slots
        # hidden); without them a [B, 1, 1, 1] stand-in keeps transformers from building masks
        has_kv = any(isinstance(layer, StaticKVLayer) for layer in static.layers)
        kv_valid = torch.zeros(b, total if has_kv else 1, dtype=torch.bool, device=dev)
        if has_kv:
            kv_valid[:, :t] = attention_mask.bool()
        dtype = next(self.model.parameters()).dtype
        kv_mask = torch.zeros(b, 1, 1, kv_valid.shape[1], dtype=dtype, device=dev)

        def step():
            if has_kv:
                kv_valid.index_fill_(1, position.view(1), True)
                kv_mask.zero_().masked_fill_(~kv_valid[:, None, None, :], torch.finfo(dtype).min)
            logits = self.step_forward(token, attention_mask=kv_mask, position_ids=position_ids,
                                cache_position=position.view(1), past_key_values=static, use_cache=True).logits
            nxt = next_tokens(logits[:, -1], sampling)
            nxt = torch.where(finished, torch.full_like(nxt, pad), nxt)
            finished.logical_or_(torch.isin(nxt, eos))
            out.index_copy_(1, step_index.view(1), nxt[:, None])
            token.copy_(nxt[:, None])
            position_ids.add_(1)
            position.add_(1)
            step_index.add_(1)

        if streamer is not None:
            streamer.put(input_ids.cpu())
            streamer.put(out[:, 0].cpu())
        done = 1

        def advance(run) -> bool:
            """One decode step; False once every sequence has ended (checked now and then)."""
            nonlocal done
            run()
            done += 1
            if streamer is not None:
                streamer.put(out[:, done - 1].cpu())
            ended = (streamer is not None or done % check_every == 0) and eos_token_id is not None
            return not (ended and bool(finished.all()))

        # the first steps run eagerly and are real steps; on CUDA they also warm up what a graph
        # capture must not see happen (allocator, cuBLAS, Triton and torch.compile), so the graph is
        # captured from the state they leave, with no copy of the buffers
        going = True
        for _ in range(min(_WARMUP_STEPS, max_new_tokens - 1)):
            going = self._eager(step, advance)
            if not going:
                break
        run = self._capture(step) if self.cuda_graph and going and done < max_new_tokens else step
        clock.lap("setup_s")
        timed_from = done
        while going and done < max_new_tokens:
            going = advance(run)
        clock.lap("decode_s")
        self.timings = {**clock.laps, **clock.peaks, "new_tokens": done, "decode_steps": done - timed_from, "state_bytes": sum(
            x.numel() * x.element_size() for layer in static.layers for x in _layer_tensors(layer))}
        if streamer is not None:
            streamer.end()
        return torch.cat([input_ids, out[:, :done]], dim=1)

    def _eager(self, step, advance) -> bool:
        """One real step outside any graph (on a side stream on CUDA, as graph warm-up wants)."""
        if not self.cuda_graph:
            return advance(step)
        stream = _side_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            going = advance(step)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return going

    def _capture(self, step):
        """Capture ``step`` as a CUDA graph (recording runs nothing) and return its replay."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return graph.replay


_WARMUP_STEPS = 2  # eager decode steps before a CUDA graph is captured


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One warm-up stream per device for every decoder: cuBLAS keeps a workspace (32 MiB on Hopper)
    for each stream it meets until the process ends, so a new stream per step leaked memory (seen
    on the H100 as +384 MiB after 12 eager steps)."""
    return torch.cuda.Stream(device)


def _join(caches: list) -> LinearizeCache:
    """One cache from the caches of consecutive slices of a batch (the first one, extended)."""
    if len(caches) == 1:
        return caches[0]
    joined = caches[0]
    for i, layer in enumerate(joined.layers):
        parts = [c.layers[i] for c in caches]
        if isinstance(layer, RecurrentLayer):
            states = [p.state for p in parts]
            if isinstance(layer.state, ops.HybridState):
                layer.state = ops.HybridState(*(torch.cat(xs) for xs in zip(*(s.tensors() for s in states))))
            else:
                layer.state = torch.cat(states)
        else:
            layer.keys = torch.cat([p.keys for p in parts])
            layer.values = torch.cat([p.values for p in parts])
        for p in parts[1:]:  # free each piece as soon as it is joined
            if isinstance(p, RecurrentLayer):
                p.state = None
            else:
                p.keys = p.values = None
    return joined


class _Clock:
    """Wall time of the phases of one call (synchronising the device at each lap only) and, on
    CUDA, the allocator's peak so far at the end of each phase (``peak_<phase>_bytes``: where a
    large batch's memory goes)."""

    def __init__(self, device):
        import time

        self.device, self.now, self.laps, self.peaks = device, time.perf_counter, {}, {}
        self.last = self.now()

    def lap(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peaks[f"peak_{name[:-2]}_bytes"] = torch.cuda.max_memory_allocated(self.device)
        now = self.now()
        self.laps[name], self.last = now - self.last, now


def _layer_tensors(layer):
    return (layer.keys, layer.values) if isinstance(layer, StaticKVLayer) else state_tensors(layer.state)


def _as_list(x) -> list[int]:
    if x is None:
        return []
    if torch.is_tensor(x):
        return [int(v) for v in x.flatten().tolist()]
    return [int(v) for v in x] if isinstance(x, (list, tuple, set)) else [int(x)]


def fast_generate(model, input_ids, attention_mask=None, *, max_new_tokens: int = 32, do_sample: bool = False,
                  temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                  eos_token_id=None, pad_token_id=None, streamer=None, cuda_graph: bool | None = None,
                  compile: bool = False, prefill_batch: int | None = None,
                  fuse_projections: bool = True) -> torch.Tensor:
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
                          fuse_projections=fuse_projections)
    return decoder.generate(
        input_ids, attention_mask, max_new_tokens=max_new_tokens, sampling=sampling,
        eos_token_id=eos_token_id, pad_token_id=pad_token_id, streamer=streamer)


# generation settings the fast loop does not implement, with the value that means "off"
_UNSUPPORTED = {"num_beams": 1, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_new_tokens": None,
                "min_length": 0, "num_return_sequences": 1, "min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0,
                "eta_cutoff": 0.0, "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None,
                "forced_bos_token_id": None, "forced_eos_token_id": None, "sequence_bias": None,
                "guidance_scale": None, "encoder_repetition_penalty": 1.0, "exponential_decay_length_penalty": None}


def decode(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
           synced_gpus=False, streamer=None, **model_kwargs):
    """The decoding loop for ``model.generate(..., custom_generate=linearize.fast.decode)``.

    ``generate()`` prepares the inputs and the generation config (``max_new_tokens``, ``do_sample``,
    ``temperature``, ``top_k``, ``top_p``, EOS/pad ids); this runs the fast path on them. Settings the
    fast path does not implement (beams, repetition penalties, ...) fail with one line.
    ``generate()`` hands a custom loop no streamer (it only shows it the prompt): to stream, call
    ``fast_generate(..., streamer=...)``.
    """
    cfg = generation_config
    for name, neutral in _UNSUPPORTED.items():
        value = getattr(cfg, name, neutral)
        if value is not None and value != neutral:
            raise LinearizeError(f"fast decoding does not support {name}={value!r}; use plain generate()")
    new = cfg.max_length - input_ids.shape[1]
    sampling = Sampling(bool(cfg.do_sample), cfg.temperature or 1.0, cfg.top_k or None,
                        cfg.top_p if cfg.top_p is not None and cfg.top_p < 1 else None) if cfg.do_sample else Sampling()
    return FastDecoder(model).generate(
        input_ids, model_kwargs.get("attention_mask"), max_new_tokens=new, sampling=sampling,
        eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id, streamer=streamer)
