"""A teacher with a real one's shapes and random weights, for speed benchmarks (tokens/s does not
depend on the weights): reads ``config.json`` and the tokenizer files from SRC (a teacher folder,
e.g. linearize's cache of the embedded SmolLM2) and writes a loadable model folder to OUT. Lets a
GPU machine time the students without carrying the 98 MB teacher.

    python dev/shape_teacher.py SRC OUT
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    src, out = map(Path, args)
    if not (src / "config.json").is_file():
        print(f"shape_teacher: no config.json in {src}", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    n = sum(p.numel() for p in model.parameters())
    print(f"random {model.config.model_type} with {n / 1e6:.1f}M parameters -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
