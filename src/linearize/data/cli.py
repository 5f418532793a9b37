"""``linearize data``: registered on the main parser by ``add_data_commands``."""

from __future__ import annotations

import argparse

from ..errors import LinearizeError
from .sources import SOURCE_HELP


def cmd_data(args) -> int:
    from ..teacher import load_tokenizer
    from .blocks import load_blocks
    from .sources import check_source

    if args.block_len < 1:  # every argument is checked before anything loads
        raise LinearizeError(f"--block-len must be a positive number of tokens, got {args.block_len}")
    check_source(args.data)
    tokenizer = load_tokenizer(None if args.tokenizer == "default" else args.tokenizer)
    for split in ("train", "validation"):
        blocks = load_blocks(args.data, tokenizer, block_len=args.block_len, split=split)
        print(f"{split}: {blocks.shape[0]} blocks of {blocks.shape[1]} tokens ({blocks.numel():,} tokens)")
    return 0


def add_data_commands(sub, common: argparse.ArgumentParser) -> None:
    """Add ``data`` to the subparsers ``sub`` of the main parser (``common``: --dtype/--device)."""
    d = sub.add_parser("data", help="tokenize and pack a text source; print its train/validation blocks",
                       description="Check a corpus: read it, tokenize with a teacher's tokenizer (only the "
                                   "tokenizer is loaded), pack into blocks and split train/validation "
                                   "deterministically (cached for training).")
    d.add_argument("--data", "--source", dest="data", default=None, metavar="SOURCE",
                   help=SOURCE_HELP + "; nothing for the Gutenberg corpus")
    d.add_argument("--tokenizer", default="default", help="whose tokenizer: a teacher as in convert (default: %(default)s)")
    d.add_argument("--block-len", type=int, default=1024, help="tokens per block (default: %(default)s)")
    d.set_defaults(func=cmd_data)
