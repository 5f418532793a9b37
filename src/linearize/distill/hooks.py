"""Forward hooks on decoder layers (or their attention modules): read a module's input or output,
or replace a layer's input."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch
from torch import nn


class StopForward(Exception):
    """Raised by a hook to end a forward early, once what a loss needs has been computed."""


def layer_input(args, kwargs) -> torch.Tensor:
    """The hidden states a decoder layer was called with (positional or keyword)."""
    return args[0] if args else kwargs["hidden_states"]


def layer_output(output) -> torch.Tensor:
    """A decoder layer's hidden states, or an attention module's output (a tensor, or a tuple led by one)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def injecting(layer: nn.Module, current: dict, tie: bool = False):
    """Make ``layer`` take ``current["hidden"]`` as its input hidden states (a forward pre-hook);
    returns the hook's handle. ``tie``: the injected input is ``hidden + 0 * (the layer's own input)``,
    so the backward still reaches the layers below (FSDP gathers each layer's weights for its backward
    from hooks on the layer's inputs and outputs, which a replaced input would cut off)."""
    def inject(module, args, kwargs):
        ref = layer_input(args, kwargs)
        hidden = current["hidden"].to(device=ref.device, dtype=ref.dtype)
        if tie:
            hidden = hidden + 0.0 * ref
        return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})
    return layer.register_forward_pre_hook(inject, with_kwargs=True)


@contextmanager
def recording(layers: dict[int, nn.Module], inputs=(), outputs=(), stop_after: int | None = None):
    """Record the inputs of ``layers[i]`` for i in ``inputs`` and the outputs for i in ``outputs``
    while the block runs; yields ``(ins, outs)`` dicts filled by the forward. ``stop_after``: raise
    ``StopForward`` once that layer has run (the caller catches it)."""
    ins: dict[int, torch.Tensor] = {}
    outs: dict[int, torch.Tensor] = {}

    def grab_in(i):
        def hook(module, args, kwargs):
            ins[i] = layer_input(args, kwargs)
        return hook

    def grab_out(i):
        def hook(module, args, output):
            outs[i] = layer_output(output)
            if i == stop_after:
                raise StopForward
        return hook

    with ExitStack() as stack:
        for i in inputs:
            stack.callback(layers[i].register_forward_pre_hook(grab_in(i), with_kwargs=True).remove)
        for i in sorted(set(outputs) | ({stop_after} if stop_after is not None else set())):
            stack.callback(layers[i].register_forward_hook(grab_out(i)).remove)
        yield ins, outs
