"""``linearize data``: registered on the main parser by ``add_data_commands``."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import LinearizeError
from .corpora import HELP
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


def cmd_generate(args) -> int:
    from .. import load_model
    from ..teacher import DEFAULT_ALIASES, DEFAULT_TEACHER, resolve_device, resolve_dtype
    from .generate import Settings, check_folder, default_name, generate_text
    from .named import generated_dir
    from .sources import check_source

    if args.tokens < 1:  # every argument is checked before the teacher loads
        raise LinearizeError(f"--tokens must be a positive number of tokens to generate, got {args.tokens}")
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    teacher = args.teacher
    if teacher.strip().lower() in DEFAULT_ALIASES:
        teacher = DEFAULT_TEACHER
    elif Path(teacher).expanduser().exists():
        teacher = str(Path(teacher).expanduser().resolve())
    if args.out is not None and args.name is not None:
        raise LinearizeError("give --out or --name, not both")
    name = args.name or default_name(args.teacher)
    out = args.out if args.out is not None else generated_dir(name)
    batch_size = args.batch_size if args.batch_size is not None else (256 if device.type == "cuda" else 8)
    settings = Settings(teacher=teacher, seed=args.seed, batch_size=batch_size, max_new_tokens=args.max_new_tokens,
                        prompt_tokens=args.prompt_tokens, temperature=args.temperature,
                        top_p=None if args.top_p >= 1 else args.top_p, prompts=args.prompts or "gutenberg",
                        dtype=str(dtype).removeprefix("torch."), device=device.type)
    settings.check()
    check_source(None if settings.prompts == "gutenberg" else settings.prompts)
    check_folder(out, settings)
    model, tokenizer = load_model(args.teacher, dtype=dtype, device=device)
    result = generate_text(model, tokenizer, out, args.tokens, settings, progress=not args.quiet)
    use = f"generated:{name}" if args.out is None else str(out)
    print(f"{result['out']}: {result['new_tokens']:,} new tokens in {result['documents']:,} documents "
          f"({result['shards']} shards); train on it with --data {use}")
    return 0


def add_data_commands(sub, common: argparse.ArgumentParser) -> None:
    """Add ``data`` to the subparsers ``sub`` of the main parser (``common``: --dtype/--device)."""
    d = sub.add_parser("data", help="tokenize and pack a text source; print its train/validation blocks",
                       description="Check a corpus: read it, tokenize with a teacher's tokenizer (only the "
                                   "tokenizer is loaded), pack into blocks and split train/validation "
                                   f"deterministically (cached for training). The extra corpora: {HELP}.")
    d.add_argument("--data", "--source", dest="data", default=None, metavar="SOURCE",
                   help=SOURCE_HELP + "; nothing for the Gutenberg corpus")
    d.add_argument("--tokenizer", default="default", help="whose tokenizer: a teacher as in convert (default: %(default)s)")
    d.add_argument("--block-len", type=int, default=1024, help="tokens per block (default: %(default)s)")
    d.set_defaults(func=cmd_data)

    more = d.add_subparsers(dest="data_command", metavar="{generate}", title="more data")
    g = more.add_parser(
        "generate", parents=[common], help="sample text from a teacher (data-free distillation), resumable",
        description="Sample text from a teacher through the fast decoder at a large batch: prompts are windows of "
                    "the training split of --prompts, continued by sampling. Each batch is saved as a shard as soon "
                    "as it is done, so a run stopped half-way and started again goes on where it stopped and ends "
                    "with the same text as a run never stopped (the same seed and settings); asking for more "
                    "tokens later adds shards. The result is a --data source: generated:NAME, or the --out folder.")
    g.add_argument("--teacher", default="default", help="the model to sample from: a teacher as in convert, or a "
                   "linearize checkpoint (default: %(default)s)")
    g.add_argument("--tokens", type=int, required=True, help="new tokens to generate (at least; whole batches)")
    g.add_argument("--name", help="store under generated:NAME in the linearize cache (default: the teacher's name)")
    g.add_argument("--out", type=Path, help="store in this folder instead (a --data source as it is)")
    g.add_argument("--seed", type=int, default=0, help="prompts and sampling seed (default: %(default)s)")
    g.add_argument("--batch-size", type=int, help="sequences per batch, one shard each (default: 256 on CUDA, 8 on CPU)")
    g.add_argument("--max-new-tokens", type=int, default=256,
                   help="longest continuation of a prompt; EOS ends one sooner (default: %(default)s)")
    g.add_argument("--prompt-tokens", type=int, default=32, help="tokens per prompt (default: %(default)s)")
    g.add_argument("--prompts", default=None, metavar="SOURCE",
                   help="where prompts come from (its training split): " + SOURCE_HELP + " (default: gutenberg)")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass; 1 for none (default: %(default)s)")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.set_defaults(func=cmd_generate)
