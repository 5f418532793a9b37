"""Fewer kernels for the same function while decoding: several projections of one input as one
matrix product, and (CUDA) a family's RMSNorm and a gated MLP's activation as one Triton kernel each.

At batch 1 a decode step is bound by kernel launches, not arithmetic (each small product costs
about the same few microseconds whatever its width), so computing q, k and v from one weight
``[Wq; Wk; Wv]`` and a gated MLP's gate and up from ``[Wg; Wu]`` saves launches per layer. The
adapters (``Adapter.fuse_qkv`` / ``Adapter.fuse_mlp``) build these modules for their family;
``linearize.decode.fused`` puts them in place for the length of a decoding call.

The concatenated weights are a snapshot of the parameters when the module is built (for inference:
a later change to the weights is not seen) and cost memory of the size of the fused weights.

With ``kernels``, ``FusedGatedMLP`` computes ``act(gate) * up`` in one launch
(``ops.gated_act_triton``) and ``FusedRMSNorm`` stands in for an RMSNorm module
(``ops.rms_norm_triton``; about eight launches each in PyTorch). Both only where the module computes
exactly the kernel's PyTorch twin (``ops.norm_act``): its class's own forward, no hooks, checked
bit for bit against the twin on the CPU (``rms_norm_kind``, ``activation_kind``), so a module that
rounds differently, or a class a future transformers release changes, keeps its own path.
"""

from __future__ import annotations

import functools
import inspect
import weakref

import torch
from torch import nn
from torch.nn import functional as F

from ..ops.norm_act import (ACTIVATIONS, add_rms_norm_kernel_takes, gated_act_kernel_takes, rms_norm,
                             rms_norm_kernel_takes)

FUSED_QKV = "fused_qkv"  # the name under which a converted layer holds its q/k/v FusedLinear (Adapter.fuse_qkv)


def _needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd would track a function of ``tensors``: the kernels here are forward-only (decoding), so
    the stand-ins run their modules' own paths where a gradient must flow (a recipe training through them)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


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


ALIGN = 8  # output columns of a fused product are padded to a multiple of this (16 bytes in bf16)


class FusedLinear(nn.Module):
    """The outputs of several ``nn.Linear`` of one input (a tuple, in their order) from one product.

    Build it with ``FusedLinear.of(*linears)``, which says None where fusing would not be exact.
    The weights are non-persistent buffers: a copy for inference, not parameters to train or save; where a
    gradient must flow (the input or one of the linears' weights requires it, grad enabled) the linears
    themselves run, so training through the stand-in trains them.
    Where the outputs' total width is not a multiple of ``ALIGN`` (q/k/v plus a gated state's gate:
    SmolLM2's 576 + 192 + 192 + 3), the weight gets zero rows up to the next multiple, so each output
    row starts 16-byte aligned: cuBLAS otherwise falls back to its slowest, unvectorised kernels. The
    padding is computed and never returned (``product`` gives a view of the first ``sum(sizes)``
    columns).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: tuple[int, ...], linears=()):
        super().__init__()
        self.sizes = tuple(sizes)
        self.linears = tuple(linears)  # a plain tuple: not submodules (their layer holds them)
        pad = -sum(self.sizes) % ALIGN
        if pad:
            weight = F.pad(weight, (0, 0, 0, pad))
            bias = None if bias is None else F.pad(bias, (0, pad))
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    @classmethod
    def of(cls, *linears) -> FusedLinear | None:
        if not fusable(*linears):
            return None
        with torch.no_grad():
            weight = torch.cat([m.weight for m in linears])
            bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
        return cls(weight, bias, tuple(m.out_features for m in linears), linears)

    def _tracked(self, x: torch.Tensor) -> bool:  # grad mode first: decoding (no_grad) reads no parameter list
        return torch.is_grad_enabled() and _needs_grad(x, *(p for m in self.linears for p in m.parameters()))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self._tracked(x):
            return tuple(m(x) for m in self.linears)
        return self.product(x).split(self.sizes, dim=-1)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """The outputs side by side, ``[..., sum(sizes)]`` (one tensor, before the split; a view of the
        padded product where the weight has padding rows). Fewer than ``ALIGN`` input rows (batch-1
        decoding: a matrix-vector product, which the padding does not help) read the weight without
        its padding rows (a contiguous view), as before the padding."""
        if self._tracked(x):
            return torch.cat([m(x) for m in self.linears], dim=-1)
        width = sum(self.sizes)
        if self.weight.shape[0] == width:
            return F.linear(x, self.weight, self.bias)
        if x.numel() < ALIGN * x.shape[-1]:
            return F.linear(x, self.weight[:width], None if self.bias is None else self.bias[:width])
        return F.linear(x, self.weight, self.bias)[..., :width]

    def extra_repr(self) -> str:
        pad = self.weight.shape[0] - sum(self.sizes)
        return (f"in_features={self.weight.shape[1]}, out_features={self.sizes}, bias={self.bias is not None}"
                + (f", padding={pad}" if pad else ""))


class FusedGatedMLP(nn.Module):
    """A gated MLP, ``down(act(gate(x)) * up(x))``, with gate and up from one product.

    Stands in for ``mlp`` (kept as a submodule: its ``down_proj`` and ``act_fn`` are the ones used).
    Build it with ``FusedGatedMLP.of(mlp)``, which says None unless ``mlp`` has plain, fusable
    ``gate_proj`` and ``up_proj`` linears, a ``down_proj`` and an ``act_fn``, and runs its class's own
    ``forward``: the adapter decides whether its family's MLPs compute this function at all.
    ``of(mlp, kernels=True)``: ``act(gate) * up`` as one Triton launch on the product (``act`` names the
    activation, ``activation_kind``) where ``act_fn`` is one the kernel computes; never under
    ``torch.compile`` (which fuses it itself), for inputs the kernel does not take, nor where a gradient must
    flow (the kernel is forward-only).
    """

    def __init__(self, mlp: nn.Module, gate_up: FusedLinear, act: str | None = None):
        super().__init__()
        self.mlp, self.gate_up, self.act = mlp, gate_up, act

    @classmethod
    def of(cls, mlp: nn.Module, kernels: bool = False) -> FusedGatedMLP | None:
        parts = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj")]
        if "forward" in vars(mlp) or not callable(getattr(mlp, "act_fn", None)) \
                or not isinstance(getattr(mlp, "down_proj", None), nn.Module):
            return None
        gate_up = FusedLinear.of(*parts)
        if gate_up is None:
            return None
        act = activation_kind(mlp.act_fn) if kernels and len(set(gate_up.sizes)) == 1 else None
        return cls(mlp, gate_up, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act is not None and not torch.compiler.is_compiling():
            h = self.gate_up.product(x)
            if gated_act_kernel_takes(h) and not _needs_grad(h):
                from ..ops import gated_act_triton as kernel  # Triton: imported on first use

                return self.mlp.down_proj(kernel.gated_act_triton(h, self.act))
            gate, up = h.split(self.gate_up.sizes, dim=-1)
        else:
            gate, up = self.gate_up(x)
        return self.mlp.down_proj(self.mlp.act_fn(gate) * up)

    def extra_repr(self) -> str:
        return f"act={self.act}" if self.act else ""


class FusedRMSNorm(nn.Module):
    """A family's RMSNorm module as one Triton launch (``ops.rms_norm_triton``), the same function.

    Stands in for ``norm`` (kept as a submodule: its ``weight`` is the one read, so no copy). Build it
    with ``FusedRMSNorm.of(norm)``, which says None unless ``rms_norm_kind(norm)`` knows the module.
    Never under ``torch.compile`` (which fuses the norm itself), for inputs the kernel does not take
    (float64, rows longer than it holds), nor where a gradient must flow (the kernel is forward-only): there
    the module's own forward runs.
    """

    def __init__(self, norm: nn.Module, eps: float, offset: bool):
        super().__init__()
        self.norm, self.eps, self.offset = norm, eps, offset

    @classmethod
    def of(cls, norm: nn.Module) -> FusedRMSNorm | None:
        kind = rms_norm_kind(norm)
        return None if kind is None else cls(norm, _eps(norm), kind == "offset")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ahead = self.__dict__.pop("_ahead", None)  # normalised already, with the add before it (add_norm_ahead)
        if ahead is not None and ahead[0] is x:
            return ahead[1]
        weight = self.norm.weight
        if torch.compiler.is_compiling() or not rms_norm_kernel_takes(x, weight) or _needs_grad(x, weight):
            return self.norm(x)
        from ..ops import rms_norm_triton as kernel  # Triton: imported on first use

        return kernel.rms_norm_triton(x, weight, self.eps, self.offset)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``: a layer's residual add and this norm after it, in one launch
        (``ops.rms_norm_triton.add_rms_norm_triton``) where the kernels take them."""
        weight = self.norm.weight
        if (torch.compiler.is_compiling() or not add_rms_norm_kernel_takes(x, residual, weight)
                or _needs_grad(x, residual, weight)):
            summed = residual + x
            return self.norm(summed), summed
        from ..ops import rms_norm_triton as kernel

        return kernel.add_rms_norm_triton(x, residual, weight, self.eps, self.offset)

    def add_norm_ahead(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + x``, normalised by this module at the same time: its next call on that very tensor
        (the next layer's input norm, or the model's final norm) returns the norm without computing it."""
        normed, summed = self.add_norm(x, residual)
        self.__dict__["_ahead"] = (summed, normed)
        return summed

    def extra_repr(self) -> str:
        return f"eps={self.eps}, offset={self.offset}"


class RopeTable(nn.Module):
    """A model's rotary embedding read from tables: ``(cos, sin)`` of every position below ``length``, computed
    once by the module itself (``RopeTable.of``), then one gather each a call instead of the module's eight
    launches (the product of positions and frequencies, the concatenation, cos, sin, their scaling and casts).
    The same bits: each table entry is the module's own arithmetic on that one position.

    Stands in for ``rotary`` (kept as a submodule) for a caller whose positions stay below ``length`` (the fast
    decoder: its prompt and new tokens); other dtypes or devices, a layer type without a table, and
    ``torch.compile`` (which fuses the module itself) run the module. Built only for RoPE types whose frequencies
    do not depend on the positions asked (not ``dynamic`` nor ``longrope``, ``rope_is_static``)."""

    def __init__(self, rotary: nn.Module, tables: dict, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.rotary, self.dtype, self.device = rotary, dtype, device
        self.tables = tables  # {layer type or None: (cos [L, R], sin [L, R])}

    @classmethod
    def of(cls, rotary: nn.Module, length: int, dtype: torch.dtype, device: torch.device,
           layer_types=()) -> RopeTable | None:
        typed = _static_rope_form(rotary)
        if typed is None or length < 1 or (typed and not layer_types):
            return None
        positions = torch.arange(length, device=device)[None]
        probe = torch.empty(1, 1, 1, dtype=dtype, device=device)
        tables = {}
        with torch.no_grad():
            for kind in (sorted(set(layer_types)) if typed else [None]):
                cos, sin = ask_rope(rotary, probe, positions, kind)
                tables[kind] = (cos[0].contiguous(), sin[0].contiguous())
        return cls(rotary, tables, dtype, device)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type=None):
        table = self.tables.get(layer_type)
        if (table is None or x.dtype != self.dtype or x.device != self.device or position_ids.dim() != 2
                or torch.compiler.is_compiling()):
            return ask_rope(self.rotary, x, position_ids, layer_type)
        cos, sin = table
        return cos[position_ids], sin[position_ids]


def ask_rope(rotary: nn.Module, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None):
    """``rotary(x, position_ids)``, told ``layer_type`` where one is given (a module serving several layer types)."""
    return rotary(x, position_ids) if layer_type is None else rotary(x, position_ids, layer_type)


def _static_rope_form(rotary: nn.Module) -> bool | None:
    """None unless ``rotary``'s frequencies are fixed (its ``rope_type``, one or one per layer type, neither
    ``dynamic`` nor ``longrope``, whose frequencies follow the largest position asked) and its forward is
    transformers' ``forward(x, position_ids[, layer_type])``; else whether it takes a layer type."""
    kinds = getattr(rotary, "rope_type", None)
    kinds = list(kinds.values()) if isinstance(kinds, dict) else [kinds]
    if not kinds or any(not isinstance(k, str) or "dynamic" in k or k == "longrope" for k in kinds):
        return None
    try:
        names = list(inspect.signature(rotary.forward).parameters)
    except (TypeError, ValueError):
        return None
    if names[:2] != ["x", "position_ids"] or not set(names[2:]) <= {"layer_type"}:
        return None
    return "layer_type" in names


def rope_is_static(rotary: nn.Module) -> bool:
    """Whether ``RopeTable`` can stand in for ``rotary`` (``_static_rope_form``)."""
    return _static_rope_form(rotary) is not None


# The decoder layers whose forward is the pre-norm pair ``h = x + attn(norm1(x)); out = h + mlp(norm2(h))``, op for
# op (transformers 5.x; checked against the class's own forward by tests/decode/test_fused_kernels.py)
PRE_NORM_LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer",
                   "SmolLM3DecoderLayer")


def residual_fusable(layer: nn.Module) -> bool:
    """Whether ``ResidualFusion`` may stand in for ``layer``'s forward: a ``PRE_NORM_LAYERS`` class of transformers
    with its class's own forward (no instance ``forward``; hooks are fine: they see the same inputs and output, as
    transformers' own output-capturing hooks do), both norms already ``FusedRMSNorm``."""
    cls = type(layer)
    return (cls.__name__ in PRE_NORM_LAYERS and cls.__module__.startswith("transformers.models.")
            and "forward" not in vars(layer) and all(hasattr(layer, n) for n in ("self_attn", "mlp"))
            and isinstance(getattr(layer, "input_layernorm", None), FusedRMSNorm)
            and isinstance(getattr(layer, "post_attention_layernorm", None), FusedRMSNorm))


class ResidualFusion:
    """A pre-norm decoder layer's forward (``residual_fusable``) with each residual add and the RMSNorm after it
    as one launch: the attention's add with the layer's second norm, and the MLP's add with ``next_norm`` (the next
    layer's input norm or the model's final one, a ``FusedRMSNorm``; None: a plain add), whose call on the sum
    then returns the norm computed here. Two launches a layer fewer; the same function. Installed as the layer's
    ``forward`` for a decoding call (``decode.fused``); keyword arguments pass to the attention as the class's
    forward passes them (anything positional: the class's own forward)."""

    def __init__(self, layer: nn.Module, next_norm: FusedRMSNorm | None):
        self.layer = layer  # a cycle through the layer's __dict__ for the call's length (decode.fused removes it)
        self.next_norm = next_norm

    def __call__(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        layer = self.layer
        if args:
            return type(layer).forward(layer, hidden_states, *args, **kwargs)
        attn = layer.self_attn(hidden_states=layer.input_layernorm(hidden_states), **kwargs)[0]
        normed, hidden = layer.post_attention_layernorm.add_norm(attn, hidden_states)
        out = layer.mlp(normed)
        if self.next_norm is None:
            return hidden + out
        return self.next_norm.add_norm_ahead(out, hidden)


# -- which modules compute the kernels' functions exactly ------------------------------------------

def _patched(m: nn.Module) -> bool:
    """Hooks or an instance ``forward``: the module may not compute what its class says."""
    return bool(m._forward_hooks or m._forward_pre_hooks or "forward" in vars(m))


def _eps(norm: nn.Module) -> float | None:
    """An RMSNorm's epsilon: ``variance_epsilon`` (Llama, Qwen, SmolLM) or ``eps`` (Gemma), one of them."""
    found = [v for k, v in vars(norm).items() if k in ("variance_epsilon", "eps")]
    return float(found[0]) if len(found) == 1 and isinstance(found[0], (int, float)) else None


def rms_norm_kind(norm: nn.Module) -> str | None:
    """How ``norm`` normalises, if it is a transformers family's RMSNorm computing ``ops.norm_act.rms_norm``
    exactly: ``"weight"`` (Llama's rounding, ``offset=False``) or ``"offset"`` (Gemma's ``1 + weight``);
    None for anything else (other classes, hooks, an instance ``forward``, buffers or submodules, or
    a forward that differs from both by one bit on the probe: checked once per class and settings,
    on the CPU, for fp32 and bf16 inputs and weights)."""
    cls = type(norm)
    if not (cls.__name__.endswith("RMSNorm") and cls.__module__.startswith("transformers.models.")):
        return None
    weight = norm._parameters.get("weight")
    if (_patched(norm) or weight is None or weight.dim() != 1 or weight.is_meta or _eps(norm) is None
            or len(norm._parameters) != 1 or norm._buffers or norm._modules):
        return None
    base = vars(nn.Module())
    settings = {k: v for k, v in vars(norm).items() if k not in base}
    if not all(isinstance(v, (bool, int, float, str, type(None))) for v in settings.values()):
        return None  # a setting the probe could not copy faithfully: leave the module alone
    return _probe_norm(cls, tuple(sorted(settings.items())))


@functools.cache
def _probe_norm(cls: type, settings: tuple) -> str | None:
    with torch.device("cpu"), torch.no_grad():
        probe = cls.__new__(cls)
        nn.Module.__init__(probe)
        for k, v in settings:
            object.__setattr__(probe, k, v)
        eps = _eps(probe)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(3, 40, generator=g) * 3 + 0.5
        w = torch.randn(40, generator=g)  # not near 1 nor 0: weight and 1 + weight differ
        for kind, offset in (("weight", False), ("offset", True)):
            if all(_same(probe, x.to(dx), w.to(dw), lambda xx, ww: rms_norm(xx, ww, eps, offset))
                   for dx, dw in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                  (torch.bfloat16, torch.float32))):
                return kind
    return None


def _same(probe: nn.Module, x: torch.Tensor, w: torch.Tensor, twin) -> bool:
    probe._parameters["weight"] = nn.Parameter(w, requires_grad=False)
    try:
        got = probe(x)
    except Exception:  # a class that needs more than the probe gives it
        return False
    want = twin(x, w)
    return isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)


def activation_kind(act: nn.Module) -> str | None:
    """The ``ops.norm_act.ACTIVATIONS`` key of the activation module ``act`` (a gated MLP's ``act_fn``)
    where it computes that function bit for bit on a CPU probe (fp32 and bf16), as transformers'
    ``silu`` and ``gelu_pytorch_tanh`` do; None for others (``gelu_python_tanh``, which rounds
    differently, parameters, hooks...)."""
    if (not isinstance(act, nn.Module) or _patched(act) or act._parameters or act._buffers or act._modules
            or not type(act).__module__.startswith(("transformers.", "torch.nn."))):
        return None
    key = (type(act), tuple(sorted((k, id(v)) for k, v in vars(act).items() if not k.startswith("_"))))
    known = _ACT_KINDS.get(act)
    if known is None or known[0] != key:  # probed once per module while its settings stay
        known = _ACT_KINDS[act] = (key, _probe_activation(act))
    return known[1]


_ACT_KINDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _probe_activation(act: nn.Module) -> str | None:
    with torch.device("cpu"), torch.no_grad():
        x = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 4
        for name, fn in ACTIVATIONS.items():
            ok = True
            for xx in (x, x.bfloat16()):
                try:
                    got = act(xx)
                except Exception:
                    return None
                want = fn(xx)
                ok = ok and isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
            if ok:
                return name
    return None
