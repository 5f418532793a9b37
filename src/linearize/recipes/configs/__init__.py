"""Recipes shipped with linearize, as YAML: ``linearize <recipe> --config NAME`` runs one (flags win).

Each file's keys are settings of its command (any field of ``LolcatsConfig`` or ``UptrainConfig``,
``budget``, and the mixer spec keys); a run's own ``run_config.json`` is read the same way.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent


def names() -> list[str]:
    return sorted(p.stem for p in HERE.glob("*.yaml"))


def packaged(name: str) -> Path | None:
    """The shipped recipe ``name`` (with or without ``.yaml``), or None."""
    path = HERE / (name if name.endswith(".yaml") else f"{name}.yaml")
    return path if path.is_file() and path.parent == HERE else None
