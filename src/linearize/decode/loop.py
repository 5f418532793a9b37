"""The fast decoder: prefill, static buffers, then one decode step replayed per token.

1. **Prefill** runs the model once over the (left-padded) prompts through the chunked forms, so a
   long prompt costs linear time (``prefill_batch`` prompts at a time).
2. The cache becomes **static buffers** of fixed shape (``decode.buffers``).
3. **One decode step** (``DecodeStep``) — model forward on one token, sampling, writing the token,
   advancing the positions — touches only those buffers and reads nothing back to the host, so on
   CUDA it is captured once as a CUDA graph and replayed per token. On the CPU it runs eagerly.
4. During the call, q/k/v and gated MLPs' gate/up are one product each, and on CUDA the RMSNorms and
   the gated activations one Triton kernel each (``decode.fused``): the step is bound by kernel
   launches, and these were most of a layer's launches outside the attention and the products.

Sequences that hit an EOS token continue as padding; the host checks for "all done" every
``check_every`` steps (``_Progress``), or every step where a streamer or stopping criteria (called on
the host, as ``generate()`` calls them) want each token; the output ends where the last sequence did,
as ``generate()``'s does.
"""

from __future__ import annotations

import functools
import time

import torch

from ..cache import LinearizeCache, cache_keyword
from ..errors import LinearizeError
from ..mixers.window import positions_below
from .buffers import StaticCache, StaticKVLayer, StaticRingKVLayer, join_caches, state_nbytes, static_cache
from .fused import fused_projections, kernels_default, rope_table
from .sampling import Sampling, next_tokens

WARMUP_STEPS = 2  # eager decode steps before a CUDA graph is captured
# A greedy step's argmax, EOS rule, token write and position advances as one Triton launch (``ops/pick_triton.py``)
# instead of four to seven PyTorch ones. On an H200 (the default's shape, 1k prompts + 512 new, 72a188b) 1.080 /
# 1.572 / 3.168 ms a step at batch 1 / 64 / 256 against 1.091 / 1.588 / 3.178 without it; False: the PyTorch ops.
PICK_KERNEL = True


def _pick_kernel(device: torch.device) -> bool:
    """Whether a greedy step on ``device`` picks with the kernel: ``PICK_KERNEL``, Triton importable, and CUDA
    (or Triton's CPU interpreter)."""
    import os

    from ..ops.availability import triton_available

    return PICK_KERNEL and triton_available() and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch: each sequence counts from 0 at its first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def unsupported_model(model) -> str | None:
    """What of ``model`` the fast decoder cannot run, as a clause for a message, or None: sliding-window
    softmax layers whose prefill cache holds no window, layers without fixed buffers for their state,
    or an attention implementation other than sdpa / eager."""
    cfg = model.config
    kept = set(cfg.linearize["keep_softmax"]) if getattr(cfg, "linearize", None) else set(range(cfg.num_hidden_layers))
    sliding = sliding_layers(cfg) & kept
    if sliding:  # decoded from a ring of the window's slots: the prefill's cache must keep that window
        layers = LinearizeCache(model).layers
        unwindowed = sorted(i for i in sliding if not getattr(layers[i], "sliding_window", None))
        if unwindowed:
            return f"sliding-window softmax layers ({unwindowed}) whose prefill cache keeps no window"
    from ..convert.layers import mixers

    unsupported = sorted(i for i, m in mixers(model).items() if not m.fast_decodable())
    if unsupported:
        return f"no fixed buffers for the state of layers {unsupported}"
    if getattr(cfg, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return f"the {cfg._attn_implementation!r} attention (it takes sdpa or eager)"
    return None


def check_supported(model) -> None:
    """One line for a model the fast decoder cannot run (``unsupported_model``)."""
    why = unsupported_model(model)
    if why is not None:
        raise LinearizeError(f"fast decoding cannot run this model: {why}; use model.generate(..., "
                             "fast_decoding=False) (linearize generate --decoder generate)")


def sliding_layers(cfg) -> set[int]:
    """The layers a config gives a sliding window: by ``layer_types``, or every layer where a window is
    set without them (Mistral)."""
    types = getattr(cfg, "layer_types", None)
    if types:
        return {i for i, t in enumerate(types) if t == "sliding_attention"}
    return set(range(cfg.num_hidden_layers)) if getattr(cfg, "sliding_window", None) else set()


class DecodeStep:
    """One decode step on fixed tensors: the step's inputs and outputs live here and are updated in
    place, so the step can be captured as a CUDA graph and replayed.

    ``token`` ``[B, 1]`` is the last token; ``out`` ``[B, n]`` collects the new tokens (pad where a
    sequence has ended), ``finished`` marks sequences past an EOS (or stopped by the host's stopping
    criteria); ``scores`` are the last step's logits ``[B, V]``, which stopping criteria are shown.
    Kept softmax layers read a ``[B, 1, 1, total]`` additive mask (padding and unwritten slots
    hidden); without them a ``[B, 1, 1, 1]`` stand-in keeps transformers from building masks. Kept
    sliding-window layers read a ``[B, 1, 1, window]`` mask of their rings' slots (``typed_masks``:
    the model takes one mask per layer type, as Gemma does).

    The bookkeeping is a few launches per step (at batch 1 each costs what a layer's norm does):
    greedy picks write the argmax straight into ``token`` (no float copy of the logits: the argmax of
    the logits' own dtype is the same token); the new token goes to ``out``'s column through the
    shared ``position`` (``out`` is a view of a row of the whole sequence, so no separate counter);
    the mask opens one slot per step in place; without an EOS nothing tracks ``finished``; with one,
    a comparison rather than ``isin``.
    """

    def __init__(self, forward, cache: StaticCache, sampling: Sampling, first: torch.Tensor,
                 attention_mask: torch.Tensor, position: torch.Tensor, *, total: int, max_new_tokens: int,
                 eos: list[int], pad: int, dtype: torch.dtype, cache_keyword: str = "past_key_values",
                 typed_masks: bool = False):
        b, t = attention_mask.shape
        self.cache_keyword = cache_keyword
        dev = attention_mask.device
        self.forward, self.cache, self.sampling, self.pad = forward, cache, sampling, pad
        self.position, self.dtype = position, dtype
        ids = sorted(as_list(eos))
        self.eos = ids[0] if len(ids) == 1 else torch.tensor(ids, device=dev) if ids else None
        self.token = first[:, None].clone()
        self.finished = torch.isin(first, torch.tensor(ids or [-1], device=dev))
        self.scores = None
        # every token of the sequence by its position (the caller writes the prompt's columns): the step
        # writes the new token at position + 1 through the view shifted by one, and ``out`` is the new tokens' part
        self.sequence = torch.full((b, t + max_new_tokens), pad, dtype=torch.long, device=dev)
        self._next = self.sequence[:, 1:]
        self.out = self.sequence[:, t:]
        self.out[:, 0] = first
        self.position_ids = positions(attention_mask)[:, -1:] + 1
        self.pick = None  # greedy: the kernel's buffers, made before any capture
        if not sampling.do_sample and _pick_kernel(dev):
            from ..ops.pick_triton import PickBuffers

            self.pick = PickBuffers.make(b, dev)
            self.eos_ids = torch.tensor(ids, dtype=torch.long, device=dev) if ids else None
        self.has_kv = any(isinstance(layer, StaticKVLayer) for layer in cache.layers)
        self.kv_mask = torch.zeros(b, 1, 1, total if self.has_kv else 1, dtype=dtype, device=dev)
        if self.has_kv:  # padding and the slots not written yet hidden; a step opens its own slot
            valid = torch.zeros(b, total, dtype=torch.bool, device=dev)
            valid[:, :t] = attention_mask.bool()
            self.kv_mask.masked_fill_(~valid[:, None, None, :], torch.finfo(dtype).min)
        self.mask = self.kv_mask
        rings = {layer.window for layer in cache.layers if isinstance(layer, StaticRingKVLayer)}
        self.has_rings = bool(rings)
        if rings:  # sliding-window layers: one ring mask (a step opens its slot, whose former token left)
            if len(rings) > 1:
                raise LinearizeError(f"fast decoding takes one sliding window for every layer, not {sorted(rings)}")
            self.window = rings.pop()
            self.ring_mask = torch.full((b, 1, 1, self.window), torch.finfo(dtype).min, dtype=dtype, device=dev)
            cols = torch.tensor(StaticRingKVLayer.prompt_columns(t, self.window), dtype=torch.long, device=dev)
            self.ring_mask[:, 0, 0, cols % self.window] = torch.zeros(b, len(cols), dtype=dtype, device=dev).masked_fill_(
                ~attention_mask[:, cols].bool(), torch.finfo(dtype).min)
            # models with layer types take one mask per type; others (Mistral) have sliding layers only
            self.mask = ({"full_attention": self.kv_mask, "sliding_attention": self.ring_mask} if typed_masks
                         else self.ring_mask)

    def __call__(self) -> None:
        if self.has_kv:
            self.kv_mask.index_fill_(3, self.position.view(1), 0.0)
        if self.has_rings:
            self.ring_mask.index_fill_(3, torch.remainder(self.position, self.window).view(1), 0.0)
        logits = self.forward(self.token, attention_mask=self.mask, position_ids=self.position_ids,
                              cache_position=self.position.view(1), **{self.cache_keyword: self.cache},
                              use_cache=True).logits
        self.scores = logits[:, -1]  # under a CUDA graph, the graph's own output (its values replayed)
        if self.pick is not None:  # the lines below as one launch
            from ..ops.pick_triton import greedy_step_triton

            greedy_step_triton(logits[:, -1], self.token, self._next, self.position, self.position_ids, self.pick,
                               self.finished, self.eos_ids, self.pad)
            return
        if self.sampling.do_sample:
            self.token.copy_(next_tokens(logits[:, -1], self.sampling)[:, None])
        else:  # greedy: the argmax of the logits' own dtype, written in place
            torch.argmax(logits[:, -1], dim=-1, keepdim=True, out=self.token)
        if self.eos is not None:
            self.token.masked_fill_(self.finished[:, None], self.pad)
            done = self.token[:, 0] == self.eos if isinstance(self.eos, int) else torch.isin(self.token[:, 0], self.eos)
            self.finished.logical_or_(done)
        self._next.index_copy_(1, self.position.view(1), self.token)
        self.position_ids.add_(1)
        self.position.add_(1)


class _Progress:
    """The host's side of the loop: how many tokens exist, the streamer, the stopping criteria, and the
    check whether every sequence has ended (a host sync: now and then, or every step where a streamer or
    stopping criteria want each token).

    ``stopping_criteria`` is called as ``generate()`` calls its own, ``(ids, scores)`` with every token so
    far (``[B, prompt + done]``) and the last logits, after each token; the sequences it returns True for
    end (padded from then on where there is an EOS id, as ``generate()`` pads them)."""

    def __init__(self, step: DecodeStep, streamer, check_every: int, stops_at_eos: bool, stopping_criteria=None,
                 prompt_len: int = 0):
        self.step, self.streamer, self.check_every = step, streamer, check_every
        self.criteria, self.prompt_len = stopping_criteria, prompt_len
        self.every_step = streamer is not None or stopping_criteria is not None
        self.stops = stops_at_eos or stopping_criteria is not None
        self.done = 1  # the prefill's token

    def going(self) -> bool:
        """After a token: the stopping criteria applied, False once every sequence has ended."""
        finished = self.step.finished
        if self.criteria is not None:
            stop = self.criteria(self.step.sequence[:, : self.prompt_len + self.done], self.step.scores)
            finished.logical_or_(torch.as_tensor(stop, device=finished.device).expand_as(finished))
        return not (self.stops and bool(finished.all()))

    def advance(self, run) -> bool:
        """One decode step through ``run``; False once every sequence has ended (checked now and then)."""
        run()
        self.done += 1
        if self.streamer is not None:
            self.streamer.put(self.step.out[:, self.done - 1].cpu())
        return self.going() if self.every_step or self.done % self.check_every == 0 else True


class FastDecoder:
    """Decode a batch of prompts with fixed buffers and, on CUDA, one CUDA graph per step.

    ``cuda_graph``: None = on CUDA devices; False = run the step eagerly (the graph's twin).
    ``keep_key_features``: keep the LoLCATs window's key features in the state (more memory) instead
    of recomputing a key's features when it leaves the window (the default).
    ``compile``: compile the decode step with ``torch.compile`` (fewer, fused kernels; the first
    call pays the compilation). ``prefill_batch``: prefill that many prompts at a time (None: all).
    ``fuse_projections``: during each call, compute q/k/v with one matrix product per converted
    layer and a gated MLP's gate/up with one (``decode.fused``: fewer kernel launches per step,
    the same function; weights concatenated afresh on every call, modules restored afterwards).
    ``fuse_kernels``: during each call, every RMSNorm module of the model and each fused gated MLP's
    ``act(gate) * up`` run as one Triton kernel each where the module computes exactly the kernel's
    function (``decode.fused``); None = on CUDA with Triton and without ``compile`` (whose own fusion
    covers them), unless ``decode.fused.KERNELS`` is False; True forces them (Triton's interpreter on
    the CPU, for tests). Triton compiles each kernel on its first use in a process (a fraction of a
    second, cached on disk for later processes), before any graph is captured.
    After each call, ``timings`` holds the seconds of prefill, setup (state buffers, the first
    eager steps, graph capture) and decoding, the number of new tokens, the steps the decoding time
    covers and the bytes of the decoding state.
    """

    def __init__(self, model, *, cuda_graph: bool | None = None, keep_key_features: bool = False,
                 compile: bool = False, prefill_batch: int | None = None, fuse_projections: bool = True,
                 fuse_kernels: bool | None = None):
        check_supported(model)
        self.model = model
        self.fuse_projections = fuse_projections
        self.fuse_kernels = (not compile and kernels_default(model)) if fuse_kernels is None else fuse_kernels
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
            out = self.model(input_ids[s : s + n], attention_mask=mask, position_ids=positions(mask),
                             **{cache_keyword(self.model): cache}, use_cache=True, logits_to_keep=1)
            logits.append(out.logits[:, -1])
            caches.append(cache)
        return torch.cat(logits), join_caches(caches)

    def _static_cache(self, cache, total: int, position: torch.Tensor) -> StaticCache:
        return static_cache(self.model, cache, total, position, keep_key_features=self.keep_key_features)

    # -- the loop --------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int = 32, sampling: Sampling = Sampling(), eos_token_id=None,
                 pad_token_id: int | None = None, streamer=None, check_every: int = 16,
                 stopping_criteria=None) -> torch.Tensor:
        """``[B, T + n]`` token ids: the prompts followed by up to ``max_new_tokens`` new tokens.

        ``attention_mask`` marks real tokens of left-padded prompts (1) and padding (0). Sequences
        that produce an ``eos_token_id`` continue with ``pad_token_id``; decoding ends early once
        every sequence has (checked every ``check_every`` steps, or every step with a streamer or
        ``stopping_criteria``), and the ids end with the token that ended the last one, as
        ``generate()``'s do. ``stopping_criteria``: a callable ``(ids, scores)`` -> ``[B]`` bools (or
        one bool), such as transformers' ``StoppingCriteriaList``, called on the host after every token.
        """
        if max_new_tokens < 1:
            raise LinearizeError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise LinearizeError("input_ids must be a non-empty [batch, length] tensor")
        # the fused weights and the RoPE tables live for this call only: a CUDA graph captured below replays within
        # it; the window layers with sinks know how far positions go (short of their reach: no sink queries of their
        # own a step)
        total = input_ids.shape[1] + max_new_tokens
        with fused_projections(self.model, enabled=self.fuse_projections, kernels=self.fuse_kernels), \
                positions_below(self.model, total), rope_table(self.model, total):
            return self._generate(input_ids, attention_mask, max_new_tokens, sampling, eos_token_id,
                                  pad_token_id, streamer, check_every, stopping_criteria)

    def _generate(self, input_ids, attention_mask, max_new_tokens, sampling, eos_token_id, pad_token_id,
                  streamer, check_every, stopping_criteria) -> torch.Tensor:
        dev = self.device
        input_ids = input_ids.to(dev)
        t = input_ids.shape[1]
        attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(dev)
        eos = as_list(eos_token_id)
        pad = pad_token_id if pad_token_id is not None else (as_list(eos_token_id) or [0])[0]

        clock = _Clock(dev)
        logits, cache = self._prefill(input_ids, attention_mask)
        clock.lap("prefill_s")
        total = t + max_new_tokens
        position = torch.tensor(t, device=dev)  # 0-d: tokens absorbed (padding included)
        static = self._static_cache(cache, total, position)
        del cache
        clock.lap("cache_s")

        step = DecodeStep(self.step_forward, static, sampling, next_tokens(logits, sampling), attention_mask,
                          position, total=total, max_new_tokens=max_new_tokens, eos=eos, pad=pad,
                          dtype=next(self.model.parameters()).dtype, cache_keyword=cache_keyword(self.model),
                          typed_masks=bool(getattr(self.model.config, "layer_types", None)))
        step.sequence[:, :t] = input_ids
        step.scores = logits
        progress = _Progress(step, streamer, check_every, bool(eos), stopping_criteria, prompt_len=t)
        if streamer is not None:
            streamer.put(input_ids.cpu())
            streamer.put(step.out[:, 0].cpu())

        # the first steps run eagerly and are real steps; on CUDA they also warm up what a graph
        # capture must not see happen (allocator, cuBLAS, Triton and torch.compile), so the graph is
        # captured from the state they leave, with no copy of the buffers
        going = progress.going()  # the prefill's token may end every sequence already
        for _ in range(min(WARMUP_STEPS, max_new_tokens - 1) if going else 0):
            going = self._eager(step, progress)
            if not going:
                break
        run = self._capture(step) if self.cuda_graph and going and progress.done < max_new_tokens else step
        clock.lap("setup_s")
        timed_from = progress.done
        while going and progress.done < max_new_tokens:
            going = progress.advance(run)
        clock.lap("decode_s")
        done = progress.done
        self.timings = {**clock.laps, **clock.peaks, "new_tokens": done, "decode_steps": done - timed_from,
                        "state_bytes": state_nbytes(static)}
        if streamer is not None:
            streamer.end()
        if eos and not progress.every_step:  # checked now and then: end where the last sequence ended
            done = last_end(step.out[:, :done], eos) or done
        return torch.cat([input_ids, step.out[:, :done]], dim=1)

    def _eager(self, step, progress) -> bool:
        """One real step outside any graph (on a side stream on CUDA, as graph warm-up wants)."""
        if not self.cuda_graph:
            return progress.advance(step)
        stream = _side_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            going = progress.advance(step)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return going

    def _capture(self, step):
        """Capture ``step`` as a CUDA graph (recording runs nothing) and return its replay."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return graph.replay


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One warm-up stream per device for every decoder: cuBLAS keeps a workspace (32 MiB on Hopper)
    for each stream it meets until the process ends, so a new stream per step leaked memory (seen
    on the H100 as +384 MiB after 12 eager steps)."""
    return torch.cuda.Stream(device)


class _Clock:
    """Wall time of the phases of one call (synchronising the device at each lap only) and, on
    CUDA, the allocator's peak so far at the end of each phase (``peak_<phase>_bytes``: where a
    large batch's memory goes)."""

    def __init__(self, device):
        self.device, self.now, self.laps, self.peaks = device, time.perf_counter, {}, {}
        self.last = self.now()

    def lap(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peaks[f"peak_{name[:-2]}_bytes"] = torch.cuda.max_memory_allocated(self.device)
        now = self.now()
        self.laps[name], self.last = now - self.last, now


def last_end(out: torch.Tensor, eos: list[int]) -> int | None:
    """How many of the new tokens ``out`` ``[B, n]`` run up to the first EOS of the sequence that ends
    last (where ``generate()`` stops), or None if some sequence has none."""
    hits = torch.isin(out, torch.tensor(eos, device=out.device))
    if not bool(hits.any(dim=1).all()):
        return None
    return int(hits.int().argmax(dim=1).max()) + 1


def as_list(x) -> list[int]:
    """Token ids given as None, an int, a list/tuple/set or a tensor, as a list of ints."""
    if x is None:
        return []
    if torch.is_tensor(x):
        return [int(v) for v in x.flatten().tolist()]
    return [int(v) for v in x] if isinstance(x, (list, tuple, set)) else [int(x)]
