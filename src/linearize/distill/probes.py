"""Modules that stand in for a student's mixers while a loss looks at them: explicit wrappers, put
in place through the family adapter's ``set_attention`` and taken out again afterwards.

- ``SoftmaxAttention(mixer)``: the teacher's softmax attention computed from the mixer's own q/k/v/o
  projections (the teacher's, for the kinds that adopt them: LoLCATs, linear, SUPRA before its
  weights move). No gradient flows through it.
- ``AttentionTransferProbe(mixer)``: LoLCATs attention transfer for one layer. It projects q/k/v
  once, computes the teacher's softmax attention and the mixer's own output from them, keeps the
  MSE between the two outputs (and optionally Hedgehog's cross-entropy between their attention
  weights) and returns the teacher's output, so the next layer sees the teacher's input.

Both answer the attention call as a mixer does (``hidden_states``, ``position_embeddings``, ...)
with ``(output, None)``.

``LayerOutputs(model)`` records what each decoder layer gives in one forward and lets a later forward
of the same input, whose model differs only from some layer on, take the earlier layers' outputs as
recorded instead of computing them again (the greedy choice of softmax layers scores every layer in turn).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.nn import functional as F

from .. import ops
from ..errors import LinearizeError
from ..mixers.base import Mixer
from ..mixers.fresh import FreshMixer
from ..models import get_adapter


def unwrap(model: nn.Module) -> nn.Module:
    """The model under a DDP / compile wrapper and under PEFT's ``PeftModel`` (the module whose
    config names the family)."""
    model = getattr(model, "module", model)  # DistributedDataParallel
    model = getattr(model, "_orig_mod", model)  # torch.compile
    get_base = getattr(model, "get_base_model", None)  # peft
    return get_base() if callable(get_base) else model


def fully_sharded(model) -> bool:
    """``model`` or one of its modules is sharded by FSDP2 (``fully_shard``, as accelerate's FSDP config does)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


@contextmanager
def root_unsharded(model: nn.Module):
    """Inside, an FSDP2-sharded ``model``'s outermost unit holds its own weights whole (the embeddings, the final
    norm and the output layer, which no decoder layer's unit holds): a call into the trunk or the head alone,
    outside the model's own forward (``recipes.lolcats.copy_loss``), finds them; each decoder layer still
    gathers its own as it runs. Nothing for a model FSDP has not sharded."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2 shards nothing
        yield
        return
    if not isinstance(model, FSDPModule):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def softmax_attention_of(mixer: Mixer, q, k, v, position_embeddings) -> torch.Tensor:
    """The softmax attention the mixer replaced, on its q/k/v (before RoPE): ``[B, H, T, D]``."""
    qr, kr = mixer.adapter.rope(mixer, q, k, position_embeddings)
    g = mixer.geometry
    return ops.softmax_attention(qr, kr, v, scale=g.scaling, softcap=g.softcap, window=g.sliding_window)


def attention_weights_xent(mixer: Mixer, q, k, position_embeddings) -> torch.Tensor:
    """Hedgehog's cross-entropy between the teacher's softmax weights and the mixer's own
    normalised attention weights (``Mixer.attention_weights``), mean over queries."""
    with torch.no_grad():
        qr, kr = mixer.adapter.rope(mixer, q, k, position_embeddings)
        g = mixer.geometry
        teacher = ops.softmax_attention_weights(qr, kr, scale=g.scaling, softcap=g.softcap, window=g.sliding_window)
    student = mixer.attention_weights(q, k, position_embeddings)
    return -(teacher * torch.log(student.clamp_min(1e-12))).sum(-1).mean()


class _Wrapper(nn.Module):
    """Holds a mixer as its only child; decoder layers that read ``attn.config`` still find it. Its state dict
    names the mixer's tensors as the mixer in place would (no ``mixer.`` level): a Trainer checkpoint written
    while probes stand in (a checkpointed stage 1 keeps them for the whole run) loads into the plain student,
    and the plain student's into a probed one."""

    def __init__(self, mixer: Mixer):
        super().__init__()
        if isinstance(mixer, FreshMixer):
            raise LinearizeError(f"layer {mixer.layer_idx}: the {mixer.kind} mixer has its own projections, so it "
                                 "cannot give the teacher's attention; use a separate teacher (distill_teacher: copy)")
        self.mixer = mixer
        self.config = mixer.config
        self._register_state_dict_hook(_without_mixer_level)
        self._register_load_state_dict_pre_hook(_with_mixer_level)


def _without_mixer_level(module, state_dict, prefix, local_metadata):
    inner = prefix + "mixer."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)


def _with_mixer_level(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    inner = prefix + "mixer."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)


class SoftmaxAttention(_Wrapper):
    """The teacher's attention from ``mixer``'s projections, without gradients."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        m = self.mixer
        with torch.no_grad():
            q, k, v = m.adapter.qkv(m, hidden_states)
            return m.adapter.out(m, softmax_attention_of(m, q, k, v, position_embeddings)), None


class AttentionTransferProbe(_Wrapper):
    """Attention transfer for one layer; ``mse`` (and ``xent`` when ``with_xent``) hold this layer's loss terms
    for the first forward since ``transfer_probes`` yielded the probe (a checkpointed layer's recompute in the
    backward is a later one). Trains on unpadded blocks (no mask is read)."""

    def __init__(self, mixer: Mixer, with_xent: bool = False, tie: bool = True):
        super().__init__(mixer)
        self.with_xent, self.tie = with_xent, tie
        self.mse: torch.Tensor | None = None
        self.xent: torch.Tensor | None = None
        # whether the next forward's loss terms are kept: set by ``transfer_probes`` each time it yields the probes,
        # cleared by the forward that keeps them (see ``forward``)
        self.armed = True

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        m = self.mixer
        m.key_mask = None
        # this layer's MSE trains this layer alone (teacher-forced: its input is what the teacher's layers
        # before it give). Back through that input there is nothing attention transfer trains: the earlier
        # mixers reach it only through the ties below, of weight 0, and the teacher's weights are frozen. Cut
        # here, the backward stops at this layer instead of running through every earlier MLP and projection
        hidden_states = hidden_states.detach()
        q, k, v = m.adapter.qkv(m, hidden_states)
        target = m.adapter.out(m, softmax_attention_of(m, q, k, v, position_embeddings)).detach()
        with m.reading(hidden_states):
            o, _ = m.sequence(q, k, v, position_embeddings, None, want_state=False)
        pred = m.adapter.out(m, o)
        mse = F.mse_loss(pred.float(), target.float())
        xent = attention_weights_xent(m, q, k, position_embeddings) if self.with_xent else None
        # a checkpointed layer runs again in the backward to give its saved tensors back; the terms that
        # recompute makes hold its whole graph (checkpoint's recompute keeps every tensor it saves), and
        # the loss read this forward's terms long before: kept, they would hold each layer's activations
        # until the next step (22 GB at 8B). Only the first forward after ``transfer_probes`` armed the probe
        # keeps its terms; a recompute comes after it
        if self.armed:
            self.mse, self.xent, self.armed = mse, xent, False
        # under FSDP tie the prediction to the layer's output with weight 0: FSDP gathers a layer's weights for
        # its backward from hooks on the layer's outputs (``AttentionMSE``); untied, the layers after keep no
        # activations for a backward that never comes
        return (target + 0.0 * pred if self.tie else target), None


@contextmanager
def swapped(model: nn.Module, make):
    """Inside, every mixer ``m`` of ``model`` (a student, possibly wrapped) is replaced by
    ``make(m)`` (a module, or None to leave it); yields ``{layer index: wrapper}``; the mixers are
    back afterwards, whatever happens inside."""
    inner = unwrap(model)
    adapter = get_adapter(inner.config)
    done = []
    try:
        for layer in adapter.layers(inner):
            m = adapter.attention(layer)
            if isinstance(m, Mixer):
                wrapper = make(m)
                if wrapper is not None:
                    adapter.set_attention(layer, wrapper)
                    done.append((layer, m, wrapper))
        yield {m.layer_idx: w for _, m, w in done}
    finally:
        for layer, m, _ in done:
            adapter.set_attention(layer, m)


@contextmanager
def transfer_probes(model: nn.Module, layers, with_xent: bool = False, tie: bool = True):
    """Attention transfer on ``layers`` (layer indices): each gets an ``AttentionTransferProbe``
    (``tie``: its prediction tied to the layer's output with weight 0, what FSDP needs), every other
    converted layer gives the teacher's output (``SoftmaxAttention``). Yields the probes by layer index.
    Inside an outer call for the same layers, yields its probes (with this call's ``tie``): a stage whose
    decoder layers are recomputed in the backward (gradient checkpointing) keeps them in place from its
    first forward to its last backward, which runs after the loss's own call has returned."""
    layers = set(layers)
    inner = unwrap(model)
    adapter = get_adapter(inner.config)
    present = {w.mixer.layer_idx: w for w in map(adapter.attention, adapter.layers(inner))
               if isinstance(w, AttentionTransferProbe)}
    if present:  # put in place by an outer call for a whole stage (a checkpointed layer recomputes in the backward)
        if set(present) != layers or any(w.with_xent != with_xent for w in present.values()):
            raise LinearizeError(f"attention transfer probes are in place on layers {sorted(present)}; asked for "
                                 f"{sorted(layers)} (xent {with_xent})")
        for w in present.values():  # the loss knows whether FSDP sharded the model by now
            w.tie, w.armed = tie, True
        yield present
        return
    with swapped(model, lambda m: AttentionTransferProbe(m, with_xent, tie) if m.layer_idx in layers
                 else SoftmaxAttention(m)) as wrappers:
        yield {i: w for i, w in wrappers.items() if i in layers}


@contextmanager
def softmax_view(model: nn.Module):
    """``model`` as its own teacher: every mixer computes the softmax attention of its projections,
    and PEFT adapters (LoRA) are off. For students whose mixers adopt the teacher's projections."""
    peft_off = getattr(model, "disable_adapter", None)
    with swapped(model, SoftmaxAttention):
        if callable(peft_off) and hasattr(model, "peft_config"):
            with peft_off():
                yield model
        else:
            yield model


class LayerOutputs:
    """Each decoder layer's output in recorded forwards of ``model``, by a key for the input (e.g. a chunk
    of rows), so that a forward of the same input whose model is the same before layer ``start`` resumes
    there: ``with outputs.resuming(key, start): model(...)`` gives layers ``0 .. start - 1`` their recorded
    outputs (no compute: each returns what it returned, the last one the input layer ``start`` then sees)
    and computes the rest. Exact where the layers before ``start`` are unchanged and deterministic."""

    def __init__(self, model: nn.Module):
        inner = unwrap(model)
        self.model = inner
        self.layers = list(get_adapter(inner.config).layers(inner))
        self.slots = None
        self.outputs: dict = {}

    @contextmanager
    def recording(self, key):
        """Inside, a forward records every layer's output under ``key`` (a later one replaces it; a layer a
        resumed forward does not run keeps what it had)."""
        kept = self.outputs[key] = list(self.outputs.get(key) or [None] * len(self.layers))

        def hook(index):
            def keep(module, args, output):
                kept[index] = output
            return keep

        handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(self.layers)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @contextmanager
    def resuming(self, key, start: int):
        """Inside, layers before ``start`` give the outputs recorded under ``key`` (``start`` 0: nothing
        changes). Each stands aside for a module that returns its recorded output, so nothing of it runs:
        no compute, no hook (under FSDP no gather of its weights)."""
        kept = self.outputs.get(key) or [None] * len(self.layers)
        if any(kept[i] is None for i in range(start)):
            raise LinearizeError(f"no output of the layers before {start} recorded for {key!r}")
        if start and self.slots is None:  # where each layer sits: its parent module and its name there
            where = {id(child): (parent, name) for parent in self.model.modules()
                     for name, child in parent.named_children()}
            self.slots = [where[id(layer)] for layer in self.layers]
        try:
            for i in range(start):
                parent, name = self.slots[i]
                setattr(parent, name, _Recorded(self.layers[i], kept[i]))
            yield
        finally:
            for i in range(start):
                parent, name = self.slots[i]
                setattr(parent, name, self.layers[i])


class _Recorded(nn.Module):
    """Stands in for a decoder layer: returns the output the layer gave in a recorded forward. What else the
    model's loop reads of the layer (Gemma's and Qwen's ``attention_type``) is the layer's."""

    def __init__(self, layer: nn.Module, output):
        super().__init__()
        object.__setattr__(self, "_layer", layer)  # not a child: its weights stay out of this module
        self.output = output

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_layer"), name)

    def forward(self, *args, **kwargs):
        return self.output
