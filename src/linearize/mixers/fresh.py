"""What the XATL mixers share: their own, freshly initialised projections in place of the teacher's.

Unlike the linearizing mixers (which adopt the teacher's q/k/v/o), an XATL mixer is a different
token mixer (RetNet retention, Mamba) trained from scratch inside the teacher's decoder layer. Of
the teacher's attention it keeps at most the output projection, under the teacher's own name
(``o_proj`` in the Llama family, ``dense`` in GPT-NeoX), so W_O can be transferred; every other
projection of the teacher is dropped. New parameters are drawn like the teacher's own
(``normal(0, initializer_range)``, zero biases) unless the architecture prescribes otherwise.

The forward answers the attention call like every mixer (``(output, None)``, state in the cache
slot); subclasses implement ``mix(x, state, offset, want_state) -> (y, state)`` where ``x`` is the
normalised hidden state ``[B, T, hidden]``, ``state`` the slot's state (None before the first
token) and ``offset`` the number of tokens the slot has absorbed (the position of ``x[:, 0]``; an
int, or a 0-d tensor when a fast decoder keeps it on the device). ``self.key_mask`` ([B, T] bool or
None) marks the real tokens of a left-padded batch: padding must leave the state untouched.
"""

from __future__ import annotations

import torch
from torch import nn

from ..cache import layer_cache, recurrent_slot
from ..errors import LinearizeError
from .base import Mixer, is_static, key_padding_mask, on_input_gpu


def output_projection_name(adapter) -> str:
    """The name under which a family keeps its attention output projection (W_O)."""
    name = getattr(adapter, "out_name", None)
    if name:
        return name
    for candidate in ("o_proj", "dense", "out_proj"):
        if candidate in adapter.part_names:
            return candidate
    raise LinearizeError(f"{type(adapter).__name__} names no output projection among {adapter.part_names}")


class FreshMixer(Mixer):
    """Base of the mixers with their own projections; ``keeps_output`` keeps the teacher's W_O."""

    keeps_output: bool = True
    # own parameters (top-level submodule names) that XATL's ``qkv`` transfer sets from the teacher's
    # attention (``load_teacher_qkv``); empty: the mixer has no counterpart of q/k/v
    teacher_qkv: tuple[str, ...] = ()

    def __init__(self, attn, adapter, geometry, spec, layer_idx, n_layers):
        super().__init__(attn, adapter, geometry, spec, layer_idx, n_layers)
        self.out_name = output_projection_name(adapter)
        teacher_out = getattr(attn, self.out_name)
        self.hidden_size = teacher_out.out_features
        self.out_width = teacher_out.in_features  # what the teacher's W_O reads
        for name in list(adapter.parts(attn)):
            if not (self.keeps_output and name == self.out_name):
                delattr(self, name)
        cfg = getattr(attn, "config", None)
        self.init_std = float(getattr(cfg, "initializer_range", None) or 0.02)

    def fresh_linear(self, n_in: int, n_out: int, bias: bool = False) -> nn.Linear:
        """A new projection drawn like the teacher's: normal(0, initializer_range), zero bias."""
        lin = nn.Linear(n_in, n_out, bias=bias)
        with torch.no_grad():
            lin.weight.normal_(0.0, self.init_std)
            if bias:
                lin.bias.zero_()
        return self.new_parameters_like(lin)

    def load_teacher_qkv(self, attn: nn.Module) -> None:
        """Set the ``teacher_qkv`` parameters from the teacher attention ``attn`` of this layer."""
        raise LinearizeError(f"{self.kind} has no counterpart of the teacher's q/k/v projections")

    @on_input_gpu
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                past_key_values=None, layer_past=None, cache=None, **kwargs):
        cache = layer_cache(cache, past_key_values, layer_past)
        slot = recurrent_slot(cache, self.layer_idx) if cache is not None else None
        state = slot.state if slot is not None else None
        if is_static(slot):  # fast decoding: the position lives on the device, every token is real
            offset, self.key_mask = slot.position, None
        else:
            offset = slot.seen if slot is not None else 0
            self.key_mask = key_padding_mask(attention_mask, hidden_states.shape[1])
        y, state = self.mix(hidden_states, state, offset, want_state=slot is not None)
        if slot is not None:
            slot.store(state, hidden_states.shape[1])
        return y, None

    def mix(self, x: torch.Tensor, state, offset: int, want_state: bool):
        raise NotImplementedError
