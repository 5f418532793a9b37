"""Ready-made ``accelerate launch`` configurations for the recipes on several GPUs.

``python -m linearize.recipes.launch ddp|fsdp`` prints the path of one, for
``accelerate launch --config_file PATH -m linearize <recipe> ...``; ``torchrun --nproc_per_node N
-m linearize <recipe> ...`` is the same as ``ddp``. ``--batch-size`` is per GPU: N GPUs train on N
times the batch of one, so give one GPU N x the batch (or N x ``--grad-accum``) to compare.
"""

from __future__ import annotations

from pathlib import Path

CONFIGS = {p.stem: p for p in sorted(Path(__file__).parent.glob("*.yaml"))}


def config_path(name: str) -> Path:
    from ...errors import LinearizeError

    if name not in CONFIGS:
        raise LinearizeError(f"no launch configuration {name!r}; choose from {', '.join(CONFIGS)}")
    return CONFIGS[name]
