"""LoRA for the recipes: peft's adapters, without two element-wise passes per adapted projection.

peft's LoRA linear computes ``base(x) + lora_B(lora_A(x)) * scaling`` as four kernels after the
base product: the two small products, a multiply by ``scaling`` and an add, the last two over the
full ``[tokens, out]`` output, and the same again in the backward. ``FusedLoraLinear`` computes the
same function as ``addmm(base(x), lora_A(x), lora_B^T, alpha=scaling)``: the up-projection, the
scaling and the add in one GEMM epilogue (one rounding instead of three under bf16 autocast).

Only the training forward changes. Weights, state dict, ``save_pretrained``, ``merge_and_unload``
and ``disable_adapter`` stay peft's: the layer is peft's own class with ``forward`` overridden, and
it falls back to peft's forward wherever the fused form does not apply (adapters disabled or
merged, several active adapters, dropout, LoRA variants such as DoRA, ``adapter_names``, inputs
whose dtypes differ outside autocast).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora.layer import Linear
from torch import nn


class FusedLoraLinear(Linear):
    """peft's LoRA ``Linear`` whose forward adds the adapter in the up-projection's GEMM."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        fused = self._fusable(x, args, kwargs)
        if fused is None:
            return super().forward(x, *args, **kwargs)
        lora_a, lora_b, scaling = fused
        result = self.base_layer(x)
        h = lora_a(x)
        out = torch.addmm(result.reshape(-1, result.shape[-1]), h.reshape(-1, h.shape[-1]), lora_b.weight.t(),
                          alpha=scaling)
        return out.view(result.shape)

    def _fusable(self, x, args, kwargs):
        """``(lora_A, lora_B, scaling)`` where one plain adapter applies, else None."""
        if args or kwargs or self.disable_adapters or self.merged or len(self.active_adapters) != 1:
            return None
        name = self.active_adapters[0]
        if name not in self.lora_A or name in getattr(self, "lora_variant", {}):
            return None
        if not isinstance(self.lora_dropout[name], nn.Identity) or self.lora_B[name].bias is not None:
            return None
        lora_a, lora_b = self.lora_A[name], self.lora_B[name]
        if not torch.is_autocast_enabled(x.device.type):  # addmm takes one dtype throughout
            if len({x.dtype, lora_a.weight.dtype, lora_b.weight.dtype, self.base_layer.weight.dtype}) != 1:
                return None
        return lora_a, lora_b, self.scaling[name]


def fuse_lora_products(model: nn.Module) -> int:
    """Give every plain peft LoRA ``Linear`` in ``model`` the fused training forward (in place);
    returns how many layers changed."""
    count = 0
    for module in model.modules():
        if type(module) is Linear:
            module.__class__ = FusedLoraLinear
            count += 1
    return count


class PeftLoraModel(PeftModel):
    """peft's model whose ``save_pretrained`` (the Trainer's checkpoints) saves the embeddings only where
    the adapters wrap them. peft's ``save_embedding_layers="auto"`` would otherwise check whether the
    vocabulary was resized by loading the base model's config through the student's config class
    (transformers warns that a ``llama`` config makes a ``linearize_llama`` one) and, for a teacher named
    by a hub id, by asking the hub, at every checkpoint; the recipes never resize it."""

    def save_pretrained(self, *args, **kwargs):
        if "save_embedding_layers" not in kwargs:
            layers = (self.get_input_embeddings(), self.get_output_embeddings())
            kwargs["save_embedding_layers"] = any(hasattr(layer, "base_layer") for layer in layers)
        return super().save_pretrained(*args, **kwargs)


def add_lora(model: nn.Module, r: int, alpha: int, targets: Sequence[str], fused: bool = True):
    """Freeze ``model`` and wrap it with LoRA adapters (rank ``r``, ``alpha``, no dropout or bias) on
    the modules named ``targets``: the peft model, its LoRA linears fused unless ``fused=False``."""
    for p in model.parameters():
        p.requires_grad_(False)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(targets), bias="none")
    with warnings.catch_warnings():  # peft asks the model the name transformers 5 deprecated (no other effect)
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        peft_model = get_peft_model(model, config)
    if type(peft_model) is PeftModel:
        peft_model.__class__ = PeftLoraModel
    if fused:
        fuse_lora_products(peft_model)
    return peft_model


def merged_from_shards(peft_model, r: int, alpha: int, targets: Sequence[str]):
    """The merged student of a LoRA model FSDP trained in place (every rank calls it: the gathers are
    collectives). The main process gathers every tensor on the CPU, puts the same adapters on a plain copy
    of the base model, loads the gathered weights into it and merges them there; the other processes keep
    nothing and return the base model as it is, sharded (they neither save nor sample it)."""
    from .engine import gathered_state
    from .launch import is_main_process

    base = peft_model.get_base_model()
    main = is_main_process()
    state = gathered_state(peft_model, keep=main)
    if not main:
        return base
    dtype = next(t.dtype for name, t in state.items() if "lora_" not in name and t.is_floating_point())
    fresh = add_lora(type(base)._from_config(base.config, dtype=dtype), r, alpha, targets)
    fresh.load_state_dict(state, strict=True)
    return fresh.merge_and_unload()

