"""What every mixer shares: adopting the teacher's projections, and the prefill / decode switch.

A mixer replaces one attention module in place and answers the same call (``hidden_states``,
``position_embeddings``, a cache as ``past_key_values`` or ``layer_past``) with ``(output, None)``.
Subclasses implement ``sequence`` (parallel/chunked form over T tokens, optionally from a state)
and ``step`` (one token from a state), both returning ``(o [B, H, T, D], state)``.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.nn import functional as F

from ..cache import layer_cache, recurrent_slot
from ..errors import LinearizeError
from ..models.base import Adapter, Geometry
from ..ops.fla_backend import triton_available
from ..spec import Spec


def key_padding_mask(attention_mask, q_len: int) -> torch.Tensor | None:
    """Which of the current ``q_len`` tokens are real (not padding): ``[B, q_len]`` bool, or None.

    Read from the mask transformers hands an attention layer: a key is real when some query may
    attend to it (4-D boolean or additive masks; 2-D padding masks as flash-attention gets them).
    """
    if attention_mask is None or _unpadded:  # inside ``unpadded_batches`` nothing is padding: read nothing
        return None
    if attention_mask.dim() == 2:
        valid = attention_mask.bool()
    elif attention_mask.dim() == 4:
        m = attention_mask[:, 0]
        allowed = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
        valid = allowed.any(dim=-2)
    else:
        return None
    valid = valid[:, -q_len:]
    if capturing():  # a CUDA graph cannot ask the host whether all are real: keep the mask as a tensor
        return valid
    return None if bool(valid.all()) else valid


def on_input_gpu(forward):
    """A mixer's ``forward`` that runs with its input's GPU current: a layer on another GPU than the current
    one (``device_map="auto"``, a model moved to ``cuda:1``, a process whose GPU is not GPU 0) would have its
    Triton kernels launched on the current device, which cannot read another's memory."""

    @functools.wraps(forward)
    def wrapped(self, hidden_states, *args, **kwargs):
        if (hidden_states.is_cuda and not torch.compiler.is_compiling()
                and hidden_states.device.index != torch.cuda.current_device()):
            with torch.cuda.device(hidden_states.device):
                return forward(self, hidden_states, *args, **kwargs)
        return forward(self, hidden_states, *args, **kwargs)

    return wrapped


def capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph (``linearize.graphed``)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


_unpadded = False


@contextlib.contextmanager
def unpadded_batches():
    """Inside, the caller vouches that every token is real (packed blocks, no attention mask passed),
    so the mixers do not read the causal mask transformers hands them (under a capture a reduction
    over it per layer would be replayed every step) and take their unmasked paths, e.g. StripedMamba's
    fused convolution."""
    global _unpadded
    before, _unpadded = _unpadded, True
    try:
        yield
    finally:
        _unpadded = before


def is_static(slot) -> bool:
    """A fast decoder's slot (``linearize.fast``): decode steps only, every token real, the mask is
    not the mixer's business (reading it would cost a host sync inside a CUDA graph)."""
    return getattr(slot, "static", False)


def drop_padding(key_mask, *tensors):
    """Zero ``[B, H, T, *]`` tensors at padded tokens, so padding adds nothing to a linear state."""
    if key_mask is None:
        return tensors
    keep = key_mask[:, None, :, None]
    return tuple(torch.where(keep, t, torch.zeros((), dtype=t.dtype, device=t.device)) for t in tensors)


def head_group_norm(o: torch.Tensor, norm: nn.GroupNorm, gate: torch.Tensor | None = None, *,
                    fused: bool = True) -> torch.Tensor:
    """``norm`` (a GroupNorm with one group per head over ``H * D`` channels) applied to ``[B, H, T, D]``,
    times ``silu(gate)`` (``[B, H, T, D]``) where a gate is given.

    The same function as ``norm(o.transpose(1, 2).reshape(B * T, H * D))``, computed as a layer norm
    over each head's D features followed by the per-channel affine (GroupNorm's CUDA backward for
    the affine parameters is slow over B * T rows of few channels; a layer norm and a plain sum are
    not). On CUDA (``fused``, Triton installed, not float64) one fused Triton kernel pair does the
    norm, the affine and the gate (``ops/group_norm_gate_triton.py``): PyTorch's layer norm is slow
    on rows of 64 features, and the separate affine and gate add launches.
    Its output is in the autocast dtype under autocast (the output projection's input dtype either
    way). Returns a ``[B, H, T, D]`` view of ``[B, T, H, D]`` storage.
    """
    h, d = o.shape[1], o.shape[3]
    # under torch.compile the PyTorch form below, which the compiler fuses itself
    if fused and o.is_cuda and o.dtype != torch.float64 and triton_available() and not torch.compiler.is_compiling():
        from ..ops.group_norm_gate_triton import group_norm_gate_triton

        if torch.is_autocast_enabled("cuda"):
            out_dtype = torch.get_autocast_dtype("cuda")
        else:
            out_dtype = o.dtype if gate is None else torch.promote_types(o.dtype, gate.dtype)
        weight, bias = (norm.weight, norm.bias) if norm.affine else (None, None)
        return group_norm_gate_triton(o.transpose(1, 2), weight, bias, norm.eps,
                                      None if gate is None else gate.transpose(1, 2), out_dtype).transpose(1, 2)
    x = F.layer_norm(o.transpose(1, 2), (d,), eps=norm.eps)  # [B, T, H, D]
    if norm.affine:
        x = x * norm.weight.view(h, d) + norm.bias.view(h, d)
    x = x.transpose(1, 2)
    return x if gate is None else x * F.silu(gate)


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` in autocast's dtype where autocast is on for its device: the projections reading it
    (q, k and v, and a LoRA adapter's on each) would each cast it anyway, and in the backward each
    cast's gradient would come back in ``x``'s dtype. Cast once instead: the same products, one
    copy forward and one backward in place of one per product."""
    device = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        if x.dtype != dtype and x.element_size() > torch.finfo(dtype).bits // 8:  # never widen
            return x.to(dtype)
    return x


class Mixer(nn.Module):
    kind: str = ""
    key_mask: torch.Tensor | None = None  # the current call's real tokens (left padding), set in forward
    position_ids: torch.Tensor | None = None  # the current call's positions, where the model passes them

    def __init__(self, attn: nn.Module, adapter: Adapter, geometry: Geometry, spec: Spec,
                 layer_idx: int, n_layers: int):
        super().__init__()
        parts = adapter.parts(attn)
        for name, module in parts.items():
            self.add_module(name, module)
        self.teacher_parts = tuple(parts)  # the teacher's modules this mixer adopted (projections, norms)
        self.adapter, self.geometry, self.spec = adapter, geometry, spec
        self.layer_idx, self.n_layers = layer_idx, n_layers
        self.config = getattr(attn, "config", None)  # kept: some decoder layers read attn.config
        ref = next(attn.parameters())
        self.teacher_device, self.teacher_dtype = ref.device, ref.dtype

    def new_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` of what the conversion added (feature maps, window weights, gates,
        decays, norms): every parameter outside the teacher's adopted modules. Attention transfer
        trains these."""
        return [(n, p) for n, p in self.named_parameters() if n.split(".", 1)[0] not in self.teacher_parts]

    @classmethod
    def covers(cls, geometry: Geometry, spec: Spec) -> bool:
        """Whether this mixer, built with ``spec``, would see all a teacher layer of ``geometry`` sees
        through softmax alone (its own sliding window): ``convert`` then keeps that layer as it is."""
        return False

    def new_parameters_like(self, module: nn.Module) -> nn.Module:
        """Put a freshly built submodule on the teacher's device and dtype."""
        return module.to(device=self.teacher_device, dtype=self.teacher_dtype)

    def fixed_buffers(self) -> dict[str, torch.Tensor | None]:
        """The mixer's constant buffers (decays, rotation frequencies), computed from its spec and
        geometry, by name. They are not saved in checkpoints: ``register_fixed_buffers`` adds them
        when the mixer is built, ``reset_fixed_buffers`` computes them again for a model that
        transformers built on the meta device and then filled from a checkpoint (``linearize.hf``)."""
        return {}

    def register_fixed_buffers(self) -> None:
        for name, value in self.fixed_buffers().items():
            self.register_buffer(name, None if value is None else value.to(self.teacher_device), persistent=False)

    def reset_fixed_buffers(self) -> None:
        """Recompute the fixed buffers in place of whatever they hold, on their current device (or,
        where they were left on the meta device, on the device of the mixer's parameters)."""
        with torch.device("cpu"):
            values = self.fixed_buffers()
        weights = next((p for p in self.parameters() if p.device.type != "meta"), None)
        for name, value in values.items():
            current = getattr(self, name)
            if value is not None and current is not None:
                device = weights.device if current.device.type == "meta" and weights is not None else current.device
                setattr(self, name, value.to(device))

    def input_projections(self) -> tuple[nn.Module, ...]:
        """The mixer's own ``nn.Linear`` projections of the layer's input (a gated state's gate), which
        the decoder may compute in one product with q/k/v (``Adapter.fuse_qkv``); none by default."""
        return ()

    def take_projections(self, outputs) -> None:
        """Receives the outputs of ``input_projections`` for the current input, computed with q/k/v."""

    @contextlib.contextmanager
    def reading(self, hidden_states):
        """Inside, ``sequence`` / ``step`` may read the layer's input ``hidden_states`` (a mixer whose
        gates are computed from it overrides this); callers that run ``sequence`` without ``forward``
        (``distill.probes``) enter it."""
        yield

    @on_input_gpu
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                past_key_values=None, layer_past=None, cache=None, **kwargs):
        cache = layer_cache(cache, past_key_values, layer_past)
        slot = recurrent_slot(cache, self.layer_idx) if cache is not None else None
        state = slot.state if slot is not None else None
        q, k, v = self.adapter.qkv(self, autocast_input(hidden_states))
        self.key_mask = key_padding_mask(attention_mask, q.shape[2]) if not is_static(slot) else None
        self.position_ids = kwargs.get("position_ids")  # [B or 1, T] where the model passes them (transformers does)
        if state is not None and q.shape[2] == 1:
            o, state = self.step(q, k, v, position_embeddings, state)
        else:
            o, state = self.sequence(q, k, v, position_embeddings, state, want_state=slot is not None)
        if slot is not None:
            slot.store(state, q.shape[2])
        return self.adapter.out(self, o), None

    def attention_weights(self, q, k, position_embeddings):
        """The mixer's normalised attention weights [B, H, T, T], for kinds that have them."""
        raise LinearizeError(f"the {self.kind} mixer has no normalised attention weights to compare (xent)")

    def sequence(self, q, k, v, position_embeddings, state, want_state: bool):
        raise NotImplementedError

    def step(self, q, k, v, position_embeddings, state):
        raise NotImplementedError

    def state_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of decoding state one sequence holds in this layer (constant in length)."""
        raise NotImplementedError

    def fast_decodable(self) -> bool:
        """Whether ``linearize.fast`` has fixed buffers for this layer's state."""
        return True

    def fast_state_bytes(self, dtype: torch.dtype) -> int:
        """The same under ``linearize.fast`` (which may keep less)."""
        return self.state_bytes(dtype)

    def extra_repr(self) -> str:
        g = self.geometry
        return f"layer={self.layer_idx}, heads={g.n_heads}, kv_heads={g.n_kv_heads}, head_dim={g.head_dim}"
