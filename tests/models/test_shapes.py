"""Named shapes (linearize.shapes, ``--teacher shape:NAME``): each shipped config builds its published
parameter count (on the meta device), builds narrower with the same structure and converts to a LoLCATs
student that runs, through ``load_teacher`` and the command line; the tokenizer paired with a shape
never gives an id past its embeddings; bad names and options fail in one line."""

import pytest
import torch
from transformers import AutoTokenizer

import linearize
from linearize import shapes, teacher
from linearize.cli import main
from linearize.errors import LinearizeError
from linearize.shapes import named_shapes, random_model, shape_config, shrunk_for_tests

from helpers import one_line

NAMES = list(named_shapes())
# the four (#55) and the embedded teacher's own
assert {"llama-3.2-1b", "llama-3-8b", "qwen2.5-7b", "llama-3-70b", "smollm2-135m"} <= set(NAMES)


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))



@pytest.mark.parametrize("name", NAMES)
def test_each_shape_builds_its_published_parameter_count_on_the_meta_device(name):
    """The shipped config against the real model's published parameter count (Llama 3 8B: 8,030,261,248),
    built where it is asked to be (meta: nothing allocated) in the asked dtype."""
    shape = named_shapes()[name]
    model = random_model(shape_config(shape), torch.bfloat16, "meta")
    assert sum(p.numel() for p in model.parameters()) == shape.parameters
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("meta", torch.bfloat16)}
    assert model.config.num_hidden_layers == shape.config["num_hidden_layers"]


@pytest.mark.parametrize("name", NAMES)
def test_each_shape_narrowed_for_tests_loads_converts_and_runs(name):
    """Through load_teacher, at a test width (shrunk_for_tests) and 2 layers: the same structure as the
    real shape (model type, heads and key/value heads, tied embeddings, RoPE), random weights on the
    device in the dtype, and a LoLCATs student of it runs a forward."""
    real = shape_config(name)
    with shrunk_for_tests(head_dim=8, vocab_size=512):
        model, tok = linearize.load_teacher(f"shape:{name},layers=2", dtype="float32", device="cpu")
    c = model.config
    assert (c.model_type, c.num_attention_heads, c.num_key_value_heads, c.tie_word_embeddings) == \
        (real.model_type, real.num_attention_heads, real.num_key_value_heads, real.tie_word_embeddings)
    assert c.rope_parameters == real.rope_parameters and c.num_hidden_layers == 2
    assert (c.head_dim, c.hidden_size, c.vocab_size) == (8, 8 * real.num_attention_heads, 512)
    assert c.intermediate_size / c.hidden_size == pytest.approx(real.intermediate_size / real.hidden_size, rel=0.01)
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("cpu", torch.float32)}
    assert model.linearize_source == f"shape:{name},layers=2" and not model.training
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == real.tie_word_embeddings

    student = linearize.convert(model, {"kind": "lolcats"})
    assert student.config.linearize["teacher"] == f"shape:{name},layers=2"
    ids = tok(["It is a truth universally acknowledged, that a shape"], return_tensors="pt").input_ids
    assert int(ids.max()) < c.vocab_size
    with torch.no_grad():
        logits = student(ids).logits
    assert logits.shape == (1, ids.shape[1], 512) and torch.isfinite(logits).all()


def test_the_weights_are_seeded_and_leave_the_callers_random_state_alone():
    with shrunk_for_tests():
        config = shape_config("llama-3.2-1b", layers=1)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = random_model(config, torch.bfloat16, "cpu")
    assert torch.equal(torch.get_rng_state(), before)
    b = random_model(config, torch.bfloat16, "cpu")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert {p.dtype for p in a.parameters()} == {torch.bfloat16}


def test_layers_keeps_the_first_layers_and_the_whole_count_is_the_whole_model():
    assert shape_config("llama-3-70b", layers=4).num_hidden_layers == 4
    assert shapes.parse("SHAPE:Llama3-70B , layers=4") == (named_shapes()["llama-3-70b"], 4)  # an alias, any case
    assert shapes.parse("shape:llama-3-8b,layers=32") == (named_shapes()["llama-3-8b"], None)  # all of them
    assert shapes.canonical(named_shapes()["llama-3-8b"], 4) == "shape:llama-3-8b,layers=4"


@pytest.mark.parametrize("spec, words", [
    ("shape:llama-4", ["unknown shape 'llama-4'", *NAMES, "random weights"]),
    ("shape:", ["unknown shape ''", *NAMES]),
    ("shape:llama-3-8b,layers=0", ["layers must be a whole number from 1 to 32"]),
    ("shape:llama-3-8b,layers=33", ["from 1 to 32", "got '33'"]),
    ("shape:llama-3-8b,layers=four", ["got 'four'"]),
    ("shape:llama-3-8b,depth=3", ["unknown shape option 'depth=3'", "layers=N"]),
    ("shape:llama-3-8b,layers", ["unknown shape option 'layers'"]),
])
def test_bad_shapes_fail_in_one_line(spec, words):
    for load in (linearize.load_teacher, teacher.load_tokenizer):
        with pytest.raises(LinearizeError) as err:
            load(spec)
        message = one_line(err)
        assert all(w in message for w in words), message


def test_a_bad_shape_on_the_command_line_is_one_error_line(tmp_path, capsys):
    assert main(["convert", "--teacher", "shape:gpt-5", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("linearize: error: unknown shape 'gpt-5'")
    assert all(name in err for name in NAMES)
    assert not (tmp_path / "x").exists()


def test_convert_from_the_command_line_with_a_shape_teacher(tmp_path, capsys):
    """``linearize convert --teacher shape:...`` writes a checkpoint that loads without the teacher, with
    the shape's tokenizer (bytes, for the narrowed vocabulary) and the shape recorded as its teacher."""
    with shrunk_for_tests():
        assert main(["convert", "--teacher", "shape:qwen2.5-7b,layers=2", "--out", str(tmp_path / "s"),
                     "--device", "cpu", "--window", "8"]) == 0
    model, tok = linearize.load(tmp_path / "s")
    assert model.config.linearize["teacher"] == "shape:qwen2.5-7b,layers=2"
    ids = tok("héllo", return_tensors="pt").input_ids
    assert ids.tolist() == [[104, 195, 169, 108, 108, 111]]  # one id per UTF-8 byte
    with torch.no_grad():
        assert model.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 10)


def test_help_says_what_shapes_are_for(capsys):
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "shape:NAME[,layers=N]" in text and "for speed and memory only" in text and "random weights" in text
    assert all(name in text for name in NAMES)
    assert all(name in text for name in teacher.NAMED_TEACHERS)  # the help names them without importing torch


# --- the tokenizer paired with a shape ---------------------------------------------------------------


def test_byte_tokenizer_round_trips_any_text_with_ids_below_257(tmp_path):
    tok = shapes.byte_tokenizer()
    text = "Ünïcode — 漢字, emoji 🙂 and\nnew lines\ttabs"
    ids = tok(text).input_ids
    assert ids == list(text.encode("utf-8")) and tok.decode(ids) == text
    assert tok.eos_token_id == tok.pad_token_id == 256 and len(tok) == 257 and tok.bos_token_id is None
    tok.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path)(text).input_ids == ids


class _Vocab:
    """A stand-in for the embedded teacher's tokenizer: only its size matters here."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


@pytest.mark.parametrize("vocab, installed, embedded_size, expect", [
    (128256, True, 49152, "embedded"),  # the real shapes: SmolLM2's ids fit
    (49152, True, 49152, "embedded"),  # SmolLM2's own shape
    (512, True, 49152, "bytes"),  # a narrowed test shape: they would not
    (128256, False, 49152, "bytes"),  # the embedded teacher's package is not installed
    (60000, True, 70000, "bytes"),  # a tokenizer larger than it was thought to be
])
def test_which_tokenizer_a_shape_gets(vocab, installed, embedded_size, expect, monkeypatch):
    embedded = _Vocab(embedded_size)
    monkeypatch.setattr(teacher, "DEFAULT_GGUF_PACKAGE", "json" if installed else "no_such_module_here")
    monkeypatch.setattr(teacher, "load_tokenizer", lambda spec=None: embedded)
    got = teacher.shape_tokenizer(vocab)
    assert (got is embedded) == (expect == "embedded")
    if expect == "bytes":
        assert len(got) == 257


@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen2.5-7b"])
def test_a_large_cpu_build_is_filled_from_the_seeded_pool(monkeypatch, name):
    """Past POOL_FILL_PARAMETERS a CPU build skips transformers' one-value-at-a-time initialisation: the
    weights are N(0, initializer_range) windows of a seeded pool, biases zero, norms as built, seeded, and
    the caller's random state untouched."""
    monkeypatch.setattr(shapes, "POOL_FILL_PARAMETERS", 0)
    monkeypatch.setattr(shapes, "POOL_SIZE", 4099)
    with shrunk_for_tests():
        config = shape_config(name, layers=2)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    a = random_model(config, torch.float32, "cpu")
    assert torch.equal(torch.get_rng_state(), before)
    std = config.initializer_range
    linears = [m for m in a.modules() if isinstance(m, torch.nn.Linear)]
    for m in linears:
        assert abs(m.weight.std().item() - std) < 0.25 * std and abs(m.weight.mean().item()) < 0.1 * std
        if m.bias is not None:
            assert torch.count_nonzero(m.bias) == 0
    if name == "qwen2.5-7b":
        assert any(m.bias is not None for m in linears)  # q/k/v biases: zeroed, not left uninitialised
    norms = [p for n, p in a.named_parameters() if "norm" in n]
    assert norms and all(torch.equal(p, torch.ones_like(p)) for p in norms)
    assert all(torch.isfinite(p).all() for p in a.parameters())
    b = random_model(config, torch.float32, "cpu")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    c = random_model(config, torch.float32, "cpu", seed=1)
    assert not torch.equal(a.model.layers[0].self_attn.q_proj.weight, c.model.layers[0].self_attn.q_proj.weight)
    with torch.no_grad():
        logits = a(torch.tensor([[1, 2, 3, 4]])).logits
    assert torch.isfinite(logits).all() and logits.std() > 0
