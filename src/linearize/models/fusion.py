"""Several projections of one input as one matrix product, where that is exactly the same function.

At batch 1 a decode step is bound by kernel launches, not arithmetic (each small product costs
about the same few microseconds whatever its width), so computing q, k and v from one weight
``[Wq; Wk; Wv]`` and a gated MLP's gate and up from ``[Wg; Wu]`` saves launches per layer. The
adapters (``Adapter.fuse_qkv`` / ``Adapter.fuse_mlp``) build these modules for their family;
``linearize.decode.fusion`` puts them in place for the length of a decoding call.

The concatenated weights are a snapshot of the parameters when the module is built (for inference:
a later change to the weights is not seen) and cost memory of the size of the fused weights.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

FUSED_QKV = "fused_qkv"  # the name under which a converted layer holds its q/k/v FusedLinear (Adapter.fuse_qkv)


def fusable(*linears) -> bool:
    """Whether one product with the concatenated weights computes exactly what ``linears`` do: plain
    ``nn.Linear`` modules (not LoRA wrappers, quantized or parametrized layers) with no hooks or
    patched ``forward``, one input size, on one device and dtype, with biases all present or all absent."""
    if not all(type(m) is nn.Linear for m in linears):  # exact type: no LoRA, quantized, parametrized
        return False
    if any(m._forward_hooks or m._forward_pre_hooks or "forward" in vars(m) for m in linears):
        return False
    if len({m.in_features for m in linears}) != 1 or any(m.weight.is_meta for m in linears):
        return False
    if len({m.bias is None for m in linears}) != 1:
        return False
    tensors = [t for m in linears for t in (m.weight, m.bias) if t is not None]
    return len({(t.device, t.dtype) for t in tensors}) == 1


class FusedLinear(nn.Module):
    """The outputs of several ``nn.Linear`` of one input (a tuple, in their order) from one product.

    Build it with ``FusedLinear.of(*linears)``, which says None where fusing would not be exact.
    The weights are non-persistent buffers: a copy for inference, not parameters to train or save.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: tuple[int, ...]):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.sizes = tuple(sizes)

    @classmethod
    def of(cls, *linears) -> FusedLinear | None:
        if not fusable(*linears):
            return None
        with torch.no_grad():
            weight = torch.cat([m.weight for m in linears])
            bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
        return cls(weight, bias, tuple(m.out_features for m in linears))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, out_features={self.sizes}, bias={self.bias is not None}"


class FusedGatedMLP(nn.Module):
    """A gated MLP, ``down(act(gate(x)) * up(x))``, with gate and up from one product.

    Stands in for ``mlp`` (kept as a submodule: its ``down_proj`` and ``act_fn`` are the ones used).
    Build it with ``FusedGatedMLP.of(mlp)``, which says None unless ``mlp`` has plain, fusable
    ``gate_proj`` and ``up_proj`` linears, a ``down_proj`` and an ``act_fn``, and runs its class's own
    ``forward``: the adapter decides whether its family's MLPs compute this function at all.
    """

    def __init__(self, mlp: nn.Module, gate_up: FusedLinear):
        super().__init__()
        self.mlp, self.gate_up = mlp, gate_up

    @classmethod
    def of(cls, mlp: nn.Module) -> FusedGatedMLP | None:
        parts = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj")]
        if "forward" in vars(mlp) or not callable(getattr(mlp, "act_fn", None)) \
                or not isinstance(getattr(mlp, "down_proj", None), nn.Module):
            return None
        gate_up = FusedLinear.of(*parts)
        return None if gate_up is None else cls(mlp, gate_up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.mlp.down_proj(self.mlp.act_fn(gate) * up)
