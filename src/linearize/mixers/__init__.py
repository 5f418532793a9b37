"""Modules that replace a softmax attention; a new mixer is one file here plus one line in ``linearize/kinds.py``."""

from .base import Mixer
from .delta import GatedDeltaAttention
from .linear import LinearAttention
from .lolcats import LolcatsAttention
from .mamba import MambaMixer
from .retnet import RetNetRetention
from .supra import SupraAttention

from .. import kinds as _kinds

MIXERS: dict[str, type[Mixer]] = {name: _kinds.mixer_class(name) for name in _kinds.names()}

__all__ = ["MIXERS", "Mixer", "GatedDeltaAttention", "LinearAttention", "LolcatsAttention", "MambaMixer", "RetNetRetention", "SupraAttention"]
