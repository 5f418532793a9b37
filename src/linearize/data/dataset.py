"""Packed blocks as a ``torch`` Dataset for the Hugging Face ``Trainer``."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from ..errors import LinearizeError


class BlockDataset(Dataset):
    """Rows of a ``[n_blocks, block_len]`` tensor as ``{"input_ids": row, "labels": row}`` examples.

    Labels equal the inputs: causal LMs in ``transformers`` shift them internally.
    """

    def __init__(self, blocks: torch.Tensor) -> None:
        if not isinstance(blocks, torch.Tensor) or blocks.dim() != 2:
            shape = tuple(blocks.shape) if isinstance(blocks, torch.Tensor) else None
            raise LinearizeError(
                f"BlockDataset needs a 2-D [n_blocks, block_len] tensor, got {type(blocks).__name__} of shape {shape}"
            )
        self.blocks = blocks.long()

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.blocks[index]
        return {"input_ids": row, "labels": row}
