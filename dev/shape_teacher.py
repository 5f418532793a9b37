"""A teacher with a real one's shapes and random weights, for speed benchmarks (tokens/s does not
depend on the weights), written to a folder: SRC is a teacher folder (its ``config.json`` and tokenizer
files, e.g. linearize's cache of the embedded SmolLM2) or a named shape (``shape:llama-3-8b``,
``shape:llama-3-70b,layers=4``: ``linearize.shapes``), and OUT a loadable model folder. The random
weights come from ``linearize.shapes.random_model``, as ``--teacher shape:NAME`` builds them; that spec
needs no folder at all, so this script is for a shape of a teacher folder's own config, or a saved copy.

    python dev/shape_teacher.py SRC OUT
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig

from linearize import load_teacher
from linearize.shapes import is_shape, random_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    src, out = args[0], Path(args[1])
    if is_shape(src):
        model, tokenizer = load_teacher(src, dtype="float32", device="cpu")
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    else:
        src = Path(src)
        if not (src / "config.json").is_file():
            print(f"shape_teacher: no config.json in {src} (nor a shape:NAME)", file=sys.stderr)
            return 1
        model = random_model(AutoConfig.from_pretrained(src), torch.float32, "cpu")
        model.save_pretrained(out)
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy(src / name, out / name)
    n = sum(p.numel() for p in model.parameters())
    print(f"random {model.config.model_type} with {n / 1e6:.1f}M parameters -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
