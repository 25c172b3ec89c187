"""`python -m recipe_hacpo.fetch --preset <pair preset> --out DIR`: a preset's two models and
the paper's data in one folder, for a GPU node without network.

Run it where the hub is reachable; carry DIR to the node. It writes

    DIR/models/<name>/    each agent's model (huggingface_hub.snapshot_download: weights,
                          config and tokenizer files), <name> the hub id's last part
    DIR/raw/<dataset>/    MATH train and the seven evaluation sets as the hub publishes them
                          (docs/REPRODUCE.md, section 1, lists them)
    DIR/data/             those converted to verl parquet (`recipe_hacpo.data.prepare --all-from`)

then checks what the node will read, with the hub switched off (HF_HUB_OFFLINE=1): every model
folder's config and tokenizer load from the folder, and the preset composes and passes the
checks made before Ray with those models and data. Last it prints the environment lines the
node needs (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE, HACPO_MODEL_A/B, HACPO_DATA_DIR).

`--no-download` does the rest without the hub: on the node, to prepare and check a carried
folder whose raw files are there. A gated model (Llama 3.2) the account has not been granted
stops with one line: accept the licence on the model's hub page, then `huggingface-cli login`
or HF_TOKEN.

The download half has not run on this project's machines (no hub there); it is tested with
huggingface_hub's snapshot_download replaced by a stand-in (tests/test_fetch.py), the
node's half for real on a tiny model and small data.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass

MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]


@dataclass(frozen=True)
class HubDataset:
    """One dataset repository of the hub and the files of it that `prepare --all-from` reads."""

    repo_id: str
    folder: str  # under DIR/raw; a name prepare.STEM_ALIASES knows
    files: tuple[str, ...]  # allow_patterns of snapshot_download


# MATH train and the seven evaluation sets of the paper (docs/REPRODUCE.md, section 1)
DATASETS = (
    HubDataset("EleutherAI/hendrycks_math", "hendrycks_math", ("*/train-*.parquet", "*/test-*.parquet")),
    HubDataset("HuggingFaceH4/MATH-500", "MATH-500", ("test.jsonl",)),
    HubDataset("openai/gsm8k", "gsm8k", ("main/*.parquet",)),
    HubDataset("opencompass/AIME2025", "aime2025", ("aime2025-I.jsonl", "aime2025-II.jsonl")),
    HubDataset("math-ai/amc23", "amc23", ("*test-*.parquet",)),
    HubDataset("math-ai/minervamath", "minervamath", ("*test-*.parquet",)),
    HubDataset("Hothan/OlympiadBench", "olympiadbench", ("OE_TO_maths_en_COMP/*.parquet",)),
)
# what the presets' training and validation read from HACPO_DATA_DIR
EXPECTED_DATA = ("math_train", "math500_test", "gsm8k_test", "aime25_test", "amc23_test", "minerva_test",
                 "olympiadbench_test")
_ENV_MODEL = re.compile(r"^\$\{oc\.env:(HACPO_MODEL_\w+),([^}]+)\}$")


class FetchError(Exception):
    """A problem with the preset, the hub or the folder, said in one line."""


def preset_models(preset: str) -> dict[str, str]:
    """{environment variable: hub id} of the preset's agents (model_path: ${oc.env:HACPO_MODEL_A,<id>})."""
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    try:
        with initialize_config_module("recipe_hacpo.configs", version_base=None):
            cfg = compose(preset)
    except HydraException as exc:
        raise FetchError(f"--preset {preset}: {str(exc).splitlines()[0]}") from None
    models = {}
    for name, agent in OmegaConf.to_container(cfg.get("agents") or {}, resolve=False).items():
        found = _ENV_MODEL.match(str(agent.get("model_path", "")))
        if not found:
            raise FetchError(f"--preset {preset}: agents.{name}.model_path={agent.get('model_path')!r} is not a hub id "
                             "read from HACPO_MODEL_A/B (expected ${oc.env:HACPO_MODEL_A,<hub id>}, as the pair presets)")
        models[found.group(1)] = found.group(2)
    if not models:
        raise FetchError(f"--preset {preset}: no agents")
    return models


def model_dir(out: str, repo_id: str) -> str:
    return os.path.join(out, "models", repo_id.split("/")[-1])


def _download(repo_id: str, local_dir: str, repo_type: str, allow: list[str]) -> None:
    """snapshot_download into `local_dir`; a gated or missing repository is one FetchError line."""
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        huggingface_hub.snapshot_download(repo_id, repo_type=repo_type, local_dir=local_dir, allow_patterns=allow)
    except GatedRepoError:
        raise FetchError(
            f"{repo_id} is gated and this account has no access: accept its licence on "
            f"https://huggingface.co/{repo_id} (logged in), then `huggingface-cli login` or set HF_TOKEN, and run "
            "this again") from None
    except RepositoryNotFoundError:
        raise FetchError(f"{repo_id}: no such {repo_type} repository on the hub, or it is private to others "
                         "(`huggingface-cli login` / HF_TOKEN if it is yours)") from None
    except Exception as exc:  # network, disk: one line
        raise FetchError(f"{repo_id}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None


def download(out: str, models: dict[str, str]) -> None:
    """Every model and dataset into `out` (the half that needs the hub)."""
    for repo_id in models.values():
        print(f"model {repo_id} -> {model_dir(out, repo_id)}", flush=True)
        _download(repo_id, model_dir(out, repo_id), "model", MODEL_FILES)
    for d in DATASETS:
        where = os.path.join(out, "raw", d.folder)
        print(f"dataset {d.repo_id} -> {where}", flush=True)
        _download(d.repo_id, where, "dataset", list(d.files))


def prepare(out: str) -> list[str]:
    """DIR/raw converted into DIR/data (prepare --all-from); what it wrote."""
    from recipe_hacpo.data import prepare as prep
    from recipe_hacpo.data.schema import DataFormatError

    raw, data = os.path.join(out, "raw"), os.path.join(out, "data")
    try:
        written = prep.convert_dir(raw, data, None, None, prep.INSTRUCTION, False)
    except DataFormatError as exc:
        raise FetchError(str(exc)) from None
    missing = [n for n in EXPECTED_DATA if not os.path.exists(os.path.join(data, f"{n}.parquet"))]
    if missing:
        raise FetchError(f"{raw}: nothing gave {', '.join(m + '.parquet' for m in missing)} (see docs/REPRODUCE.md, "
                         "section 1, for the files of each dataset)")
    return written


def node_environment(out: str, models: dict[str, str]) -> dict[str, str]:
    """The environment the node runs with: the hub off, the models and data from `out`."""
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.update({var: os.path.abspath(model_dir(out, repo_id)) for var, repo_id in sorted(models.items())})
    env["HACPO_DATA_DIR"] = os.path.abspath(os.path.join(out, "data"))
    return env


def check_offline(preset: str, out: str, models: dict[str, str]) -> None:
    """What the node reads, read here with the hub off: each model's config and tokenizer from its
    folder, and the preset with those paths through every check made before Ray."""
    env = node_environment(out, models)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        from transformers import AutoConfig, AutoTokenizer

        for var, repo_id in sorted(models.items()):
            path = env[var]
            try:
                AutoConfig.from_pretrained(path, local_files_only=True)
                AutoTokenizer.from_pretrained(path, local_files_only=True)
            except Exception as exc:
                raise FetchError(f"{path} ({repo_id}): does not load without the hub: "
                                 f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
        _check_preset(preset)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _check_preset(preset: str) -> None:
    from hydra import compose, initialize_config_module

    from recipe_hacpo.config import validate
    from recipe_hacpo.data.schema import DataFormatError
    from recipe_hacpo.hacpo_settings import ConfigError
    from recipe_hacpo.main import check_data

    with initialize_config_module("recipe_hacpo.configs", version_base=None):
        cfg = compose(preset)
    try:
        validate(cfg, check_paths=True)
        check_data(cfg)
    except (ConfigError, DataFormatError) as exc:
        raise FetchError(f"--preset {preset} with this folder: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recipe_hacpo.fetch",
        description="A pair preset's models and the paper's data into one folder, for a node without network.")
    parser.add_argument("--preset", required=True, help="a pair preset, e.g. pair_qwen3-1p7b-base_qwen3-4b-base")
    parser.add_argument("--out", required=True, help="the folder to fill (models/, raw/, data/)")
    parser.add_argument("--no-download", action="store_true",
                        help="only prepare and check a folder already filled (on the node: no hub needed)")
    args = parser.parse_args(argv)
    try:
        models = preset_models(args.preset)
        if not args.no_download:
            download(args.out, models)
        for path in prepare(args.out):
            print(f"wrote {path}")
        check_offline(args.preset, args.out, models)
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"# {args.out} holds everything {args.preset} reads; on the node (the folder at the same path):")
    for key, value in node_environment(args.out, models).items():
        print(f"export {key}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
