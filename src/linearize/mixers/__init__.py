"""Modules that replace a softmax attention; a new mixer is one file plus a line in ``MIXERS``."""

from .base import Mixer
from .delta import GatedDeltaAttention
from .linear import LinearAttention
from .lolcats import LolcatsAttention
from .mamba import MambaMixer
from .retnet import RetNetRetention
from .supra import SupraAttention

MIXERS: dict[str, type[Mixer]] = {
    "linear": LinearAttention,
    "lolcats": LolcatsAttention,
    "supra": SupraAttention,
    "retnet": RetNetRetention,
    "striped_mamba": MambaMixer,
    "delta": GatedDeltaAttention,
}

__all__ = ["MIXERS", "Mixer", "GatedDeltaAttention", "LinearAttention", "LolcatsAttention", "MambaMixer", "RetNetRetention", "SupraAttention"]
