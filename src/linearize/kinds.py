"""Every mixer kind, by name: one line each. Adding a mixer is its file in ``mixers/`` plus one line here.

Each entry names the class (``module:Class`` under ``linearize.mixers``) and its role:

- ``convert``: the mixer adopts the teacher's q/k/v/o and adds a few weights (LoLCATs, SUPRA):
  ``linearize convert`` / ``lolcats`` / ``supra`` build it from a teacher;
- ``build``: a different token mixer with its own projections, trained from the teacher's shared
  weights (XATL): ``linearize xatl --arch`` builds it.

Every list of kinds derives from ``KINDS``: ``spec.KINDS`` (what a spec accepts), the CLI's
``--kind`` and ``--arch`` choices, ``convert.xatl_transfer.ARCHITECTURES``, ``bench.train.MODELS``, the XATL
recipe's ``arch`` field. Nothing here imports the mixers: ``mixers.MIXERS`` does, from these names.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MixerKind:
    name: str
    target: str  # "module:Class" under linearize.mixers
    role: str  # "convert" or "build"
    help: str
    aliases: tuple[str, ...] = ()


KINDS: dict[str, MixerKind] = {}


def register(kind: MixerKind) -> MixerKind:
    """Add a kind (a test or a plug-in may call this; the package's own kinds are listed below)."""
    KINDS[kind.name] = kind
    return kind


register(MixerKind("lolcats", "lolcats:LolcatsAttention", "convert", "softmax over a sliding window + linear attention for older tokens (LoLCATs)"))
register(MixerKind("linear", "linear:LinearAttention", "convert", "normalised linear attention with learned feature maps"))
register(MixerKind("supra", "supra:SupraAttention", "convert", "shared ReLU-MLP kernel, RoPE after it, fixed decay, GroupNorm (SUPRA)"))
register(MixerKind("retnet", "retnet:RetNetRetention", "build", "multi-scale retention with new q/k/v/gate, the teacher's W_O (XATL)"))
register(MixerKind("striped_mamba", "mamba:MambaMixer", "build", "a Mamba mixer in each block, the FFN kept (XATL)", aliases=("mamba",)))
register(MixerKind("delta", "delta:GatedDeltaAttention", "convert", "softmax over a sliding window + a gated delta-rule memory (Gated DeltaNet) for older tokens"))


def names(role: str | None = None) -> tuple[str, ...]:
    """The kinds' names, in registration order (``role``: only those of that role)."""
    return tuple(k.name for k in KINDS.values() if role is None or k.role == role)


def architectures() -> dict[str, str]:
    """XATL architecture names (kinds of role ``build`` and their aliases) -> kind."""
    out = {}
    for k in KINDS.values():
        if k.role == "build":
            out[k.name] = k.name
            out.update({a: k.name for a in k.aliases})
    return out


def mixer_class(name: str):
    """The ``Mixer`` subclass of a kind (imported on first use)."""
    import importlib

    module, cls = KINDS[name].target.split(":")
    return getattr(importlib.import_module(f"linearize.mixers.{module}"), cls)


def help_text(role: str | None = None) -> str:
    """``name: what it is; ...`` for ``--help``."""
    return "; ".join(f"{k.name}: {k.help}" for k in KINDS.values() if role is None or k.role == role)
