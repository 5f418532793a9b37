"""Text sampled from a teacher (data-free distillation): ``linearize data generate``.

Prompts are short windows of the training split of a corpus (the Gutenberg books by default); the
teacher continues them through the fast decoder (for a softmax teacher its static KV cache, on CUDA
one CUDA graph per step) at a large batch. Each batch is one shard, ``part-NNNNNN.jsonl`` (one
``{"text": prompt + continuation, "new_tokens": n}`` per line), written atomically; ``manifest.json``
records the settings. The folder is a source as it is (``--data DIR``, or ``generated:NAME`` for a
folder under ``cache_dir("generated")``).

Batch ``i`` depends only on the settings and ``i``: its prompts are a seeded choice, its sampling
seeded from ``seed`` and ``i``. So a run that is stopped (killed, out of time) and started again
goes on from its last whole shard, and ends with the same shards as a run never stopped; asking a
finished folder for more tokens adds shards. Settings that would change the shards (teacher, seed,
batch size, lengths, sampling, prompts, dtype, device type) must match the manifest's.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..errors import LinearizeError
from ..paths import read_json_lines

FORMAT = 1
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Settings:
    """Everything the shards depend on (not the number of tokens: more tokens add shards)."""

    teacher: str
    seed: int = 0
    batch_size: int = 8
    max_new_tokens: int = 256
    prompt_tokens: int = 32
    temperature: float = 1.0
    top_p: float | None = 0.95
    prompts: str = "gutenberg"
    dtype: str = "float32"
    device: str = "cpu"
    format: int = FORMAT

    def check(self) -> None:
        """One line for a setting out of range (before anything loads)."""
        for name in ("batch_size", "max_new_tokens", "prompt_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LinearizeError(f"{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if not self.temperature > 0:
            raise LinearizeError(f"temperature must be > 0 (text is sampled), got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise LinearizeError(f"top-p must be in (0, 1], got {self.top_p}")


def default_name(teacher: str | None) -> str:
    """A name for a teacher's generated text: its file or model name."""
    from ..teacher import DEFAULT_ALIASES, DEFAULT_TEACHER

    if teacher is None or str(teacher).strip().lower() in DEFAULT_ALIASES:
        return DEFAULT_TEACHER
    stem = Path(str(teacher).rstrip("/")).name
    stem = stem[: -len(".gguf")] if stem.lower().endswith(".gguf") else stem
    return re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-.") or "teacher"


def check_folder(out: Path, settings: Settings) -> None:
    """Fail at once if ``out`` cannot hold this run: a file, or a folder of another run's shards."""
    if out.exists() and not out.is_dir():
        raise LinearizeError(f"--out {out} is a file; give a folder (new, or one this command wrote)")
    manifest = out / MANIFEST
    if manifest.is_file():
        try:
            recorded = json.loads(manifest.read_text())
        except ValueError:
            raise LinearizeError(f"{manifest} is not valid JSON; remove it or give another folder") from None
        ours = asdict(settings)
        diff = sorted(k for k in set(ours) | set(recorded) if ours.get(k) != recorded.get(k))
        if diff:
            was = ", ".join(f"{k}={recorded.get(k)!r}" for k in diff)
            raise LinearizeError(f"{out} holds text generated with other settings ({was}); repeat them to go on, "
                                 "or give another folder / name")
    elif out.is_dir() and any(out.iterdir()):
        raise LinearizeError(f"{out} is a folder not written by this command (no {MANIFEST}); give a new one")


def shard_path(out: Path, index: int) -> Path:
    return out / f"part-{index:06d}.jsonl"


def _contents(out: Path) -> tuple[int, int, int]:
    """(whole shards from the first on, documents in them, new tokens in them): one read of each shard."""
    index = documents = tokens = 0
    while shard_path(out, index).is_file():
        records = read_json_lines(shard_path(out, index))
        documents += len(records)
        tokens += sum(record["new_tokens"] for record in records)
        index += 1
    return index, documents, tokens


def done_so_far(out: Path) -> tuple[int, int]:
    """(whole shards from the first on, new tokens in them)."""
    shards, _, tokens = _contents(out)
    return shards, tokens


def generate_text(model, tokenizer, out: str | Path, tokens: int, settings: Settings, *,
                  progress: bool = True, cuda_graph: bool | None = None) -> dict:
    """Sample at least ``tokens`` new tokens from ``model`` into the folder ``out`` (see the module
    docstring); returns what the folder holds: ``{"out", "shards", "documents", "new_tokens"}``."""
    from ..decode import FastDecoder, Sampling
    from .blocks import load_blocks

    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise LinearizeError(f"tokens must be a positive integer, got {tokens!r}")
    settings.check()
    out = Path(out).expanduser()
    check_folder(out, settings)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / MANIFEST).is_file():
        _write_atomic(out / MANIFEST, json.dumps(asdict(settings), indent=1) + "\n")

    source = None if settings.prompts == "gutenberg" else settings.prompts
    prompts = load_blocks(source, tokenizer, block_len=settings.prompt_tokens, split="train")
    index, done = done_so_far(out)
    device = next(model.parameters()).device
    eos = _eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    decoder = FastDecoder(model, cuda_graph=cuda_graph)
    sampling = Sampling(True, settings.temperature, None, settings.top_p)
    with tqdm(total=tokens, initial=min(done, tokens), unit="tok", unit_scale=True, desc="generating",
              disable=not progress) as bar:
        while done < tokens:
            ids = _prompts(prompts, index, settings)
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(settings.seed * 1_000_003 + index)
                rows = decoder.generate(ids.to(device), max_new_tokens=settings.max_new_tokens, sampling=sampling,
                                        eos_token_id=eos or None, pad_token_id=pad).cpu()
            records = _records(rows, settings.prompt_tokens, eos, tokenizer)
            _write_shard(shard_path(out, index), records)
            new = sum(r["new_tokens"] for r in records)
            done += new
            index += 1
            bar.update(min(new, max(0, tokens - bar.n)))
    return summary(out)


def summary(out: Path) -> dict:
    shards, documents, new_tokens = _contents(out)
    return {"out": str(out), "shards": shards, "documents": documents, "new_tokens": new_tokens}


def _prompts(prompts: torch.Tensor, index: int, settings: Settings) -> torch.Tensor:
    """Batch ``index``'s prompts: consecutive slots of a seeded order of all prompt windows, a new
    order for each pass over them."""
    n, b = prompts.shape[0], settings.batch_size
    slots = torch.arange(index * b, (index + 1) * b)
    picked = []
    for epoch in torch.unique(slots // n).tolist():
        order = torch.randperm(n, generator=torch.Generator().manual_seed(settings.seed * 7919 + epoch))
        mine = slots[slots // n == epoch] % n
        picked.append(order[mine])
    return prompts[torch.cat(picked)]


def _records(rows: torch.Tensor, prompt_len: int, eos: list[int], tokenizer) -> list[dict]:
    """Each row's prompt and continuation as text, the continuation cut before its first EOS."""
    records = []
    for row in rows:
        new = row[prompt_len:].tolist()
        end = next((i for i, t in enumerate(new) if t in eos), len(new))
        text = tokenizer.decode(row[:prompt_len].tolist() + new[:end], skip_special_tokens=True)
        records.append({"text": text, "new_tokens": end})
    return records


def _eos_ids(model, tokenizer) -> list[int]:
    gen = getattr(model, "generation_config", None)
    ids = getattr(gen, "eos_token_id", None) if gen is not None else None
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return sorted({int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])})


def _write_shard(path: Path, records: list[dict]) -> None:
    _write_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: a reader (or a resumed run)
    sees the whole file or none of it."""
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
