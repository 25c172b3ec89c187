"""`python -m recipe_hacpo.fetch`: a preset's models and the paper's data in one folder for a
node without network. The node's half runs for real with every connection refused (a tiny model
folder and small raw data laid out as the hub publishes them); the download half against a
stand-in for huggingface_hub.snapshot_download that serves the same files from memory."""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import socket
import types

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recipe_hacpo import fetch

PRESET = "pair_qwen3-1p7b-base_qwen3-4b-base"
MODELS = {"HACPO_MODEL_A": "Qwen/Qwen3-1.7B-Base", "HACPO_MODEL_B": "Qwen/Qwen3-4B-Base"}


def _parquet(records):
    return lambda path: pq.write_table(pa.Table.from_pylist(records), path)


def _jsonl(records):
    def write(path):
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    return write


def _math(n, tag):
    return [{"problem": f"{tag} {i}", "solution": f"so \\boxed{{{i}}}"} for i in range(n)]


# each dataset repository's files as the hub holds them (a writer per path), socratic included
HUB_DATASETS = {
    "EleutherAI/hendrycks_math": {f"{s}/{split}-00000-of-00001.parquet": _parquet(_math(2, f"{s} {split}"))
                                  for s in ("algebra", "geometry") for split in ("train", "test")},
    "HuggingFaceH4/MATH-500": {"test.jsonl": _jsonl([{"problem": "p", "answer": "7"}]), "README.md": _jsonl([])},
    "openai/gsm8k": {f"{c}/{split}-00000-of-00001.parquet": _parquet([{"question": f"{c} q", "answer": "x #### 4"}])
                     for c in ("main", "socratic") for split in ("train", "test")},
    "opencompass/AIME2025": {"aime2025-I.jsonl": _jsonl([{"question": "a", "answer": "1"}]),
                             "aime2025-II.jsonl": _jsonl([{"question": "b", "answer": "2"}])},
    "math-ai/amc23": {"data/test-00000-of-00001.parquet": _parquet([{"question": "c", "answer": 3.0}])},
    "math-ai/minervamath": {"data/test-00000-of-00001.parquet": _parquet([{"question": "m", "answer": "5"}])},
    "Hothan/OlympiadBench": {
        "OE_TO_maths_en_COMP/train-00000-of-00001.parquet": _parquet([{"question": "o", "final_answer": ["6"]}]),
        "OE_MM_maths_en_COMP/train-00000-of-00001.parquet": _parquet([{"question": "image", "final_answer": ["0"]}]),
    },
}


class StandInHub:
    """snapshot_download over HUB_DATASETS and tiny model folders: writes the files that match
    allow_patterns (fnmatch, as the hub's filter) into local_dir and logs each call."""

    def __init__(self, models: dict[str, str], gated=()):
        self.models, self.gated, self.calls = models, set(gated), []

    def snapshot_download(self, repo_id, *, repo_type=None, local_dir=None, allow_patterns=None, **kw):
        self.calls.append((repo_id, repo_type, local_dir, tuple(allow_patterns or ())))
        if repo_id in self.gated:
            from huggingface_hub.errors import GatedRepoError

            raise GatedRepoError("403 gated", response=types.SimpleNamespace(headers={}, status_code=403, request=None))
        os.makedirs(local_dir, exist_ok=True)
        if repo_type == "model":
            src = self.models[repo_id]
            for name in os.listdir(src):
                if any(fnmatch.fnmatch(name, p) for p in allow_patterns):
                    shutil.copy2(os.path.join(src, name), os.path.join(local_dir, name))
            return local_dir
        for rel, write in HUB_DATASETS[repo_id].items():
            if any(fnmatch.fnmatch(rel, p) for p in allow_patterns):
                os.makedirs(os.path.dirname(os.path.join(local_dir, rel)), exist_ok=True)
                write(os.path.join(local_dir, rel))
        return local_dir


@pytest.fixture()
def no_network(monkeypatch):
    """Every connection refused, the hub switched off: what a node without network sees."""
    real = socket.socket.connect

    def refuse(self, address):
        if self.family == socket.AF_UNIX:
            return real(self, address)
        raise OSError(f"network unreachable (test): {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    for var in ("HACPO_MODEL_A", "HACPO_MODEL_B", "HACPO_DATA_DIR"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture()
def tiny_models(tiny_agent_paths, tmp_path) -> dict[str, str]:
    """The preset's two hub ids, each served by a tiny agent's folder (config, weights, tokenizer)
    whose context is Qwen3's (the preset's max_model_len needs more than the tiny agents' 2048)."""
    served = {}
    for repo_id, src in zip(MODELS.values(), list(tiny_agent_paths.values())[:2]):
        dst = tmp_path / "hub" / repo_id
        shutil.copytree(src, dst)
        config = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32768}))
        served[repo_id] = str(dst)
    return served


def _error(err: str) -> str:
    """The one error line of a failed run (prepare's progress lines go to stderr too)."""
    [line] = [x for x in err.splitlines() if x.startswith("error:")]
    return line


def test_the_preset_names_its_two_hub_models():
    assert fetch.preset_models(PRESET) == MODELS
    assert fetch.preset_models("pair_qwen3-4b-base_qwen3-8b-base_lora_1gpu")["HACPO_MODEL_B"] == "Qwen/Qwen3-8B-Base"
    with pytest.raises(fetch.FetchError, match=r"agents\.\w+\.model_path=.* is not a hub id read from HACPO_MODEL_A/B"):
        fetch.preset_models("hacpo_cpu_demo")


def test_download_then_the_node_reads_everything_with_the_hub_unreachable(tmp_path, tiny_models, monkeypatch, capsys):
    import huggingface_hub

    hub = StandInHub(tiny_models)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub.snapshot_download)
    out = tmp_path / "carry"
    for var in ("HACPO_MODEL_A", "HACPO_MODEL_B", "HACPO_DATA_DIR"):
        monkeypatch.delenv(var, raising=False)
    assert fetch.main(["--preset", PRESET, "--out", str(out)]) == 0, capsys.readouterr().err
    # the download half: both models, then the eight datasets, each into its folder
    assert [(c[0], c[1]) for c in hub.calls] == [(m, "model") for m in MODELS.values()] + [
        (d.repo_id, "dataset") for d in fetch.DATASETS]
    assert hub.calls[0][2] == str(out / "models" / "Qwen3-1.7B-Base") and "*.safetensors" in hub.calls[0][3]
    assert not (out / "raw" / "gsm8k" / "socratic").exists() and not (out / "raw" / "MATH-500" / "README.md").exists()
    printed = capsys.readouterr().out
    env = dict(line.removeprefix("export ").split("=", 1) for line in printed.splitlines() if line.startswith("export "))
    assert env == {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                   "HACPO_MODEL_A": str(out / "models" / "Qwen3-1.7B-Base"),
                   "HACPO_MODEL_B": str(out / "models" / "Qwen3-4B-Base"), "HACPO_DATA_DIR": str(out / "data")}
    assert sorted(os.listdir(out / "data")) == sorted(f"{n}.parquet" for n in (
        *fetch.EXPECTED_DATA, "math_test", "gsm8k_train"))
    assert [r["prompt"][0]["content"][:6] for r in pq.read_table(out / "data" / "gsm8k_test.parquet").to_pylist()] == ["main q"]


def test_the_nodes_half_runs_without_the_hub(tmp_path, tiny_models, no_network, monkeypatch, capsys):
    """The folder carried to the node (models and raw files, nothing prepared): `--no-download`
    prepares the data, loads each model's config and tokenizer from its folder and runs the
    preset's checks, with every connection refused; the environment it prints makes the preset
    read only that folder."""
    import huggingface_hub

    out = tmp_path / "carry"
    for repo_id, src in tiny_models.items():
        shutil.copytree(src, fetch.model_dir(str(out), repo_id))
    for d in fetch.DATASETS:
        StandInHub({}).snapshot_download(d.repo_id, repo_type="dataset", local_dir=str(out / "raw" / d.folder),
                                         allow_patterns=list(d.files))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("the node downloaded"))
    assert fetch.main(["--preset", PRESET, "--out", str(out), "--no-download"]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    env = dict(line.removeprefix("export ").split("=", 1) for line in printed.splitlines() if line.startswith("export "))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    from helpers.compose import compose_config

    from recipe_hacpo.config import validate

    cfg = compose_config(PRESET)
    specs, _ = validate(cfg, check_paths=True)
    assert {s.model_path for s in specs} == {env["HACPO_MODEL_A"], env["HACPO_MODEL_B"]}
    assert cfg.data.train_files == str(out / "data" / "math_train.parquet")
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(env["HACPO_MODEL_A"], local_files_only=True)


def test_a_missing_model_folder_on_the_node_is_one_line(tmp_path, no_network, capsys):
    out = tmp_path / "carry"
    for d in fetch.DATASETS:
        StandInHub({}).snapshot_download(d.repo_id, repo_type="dataset", local_dir=str(out / "raw" / d.folder),
                                         allow_patterns=list(d.files))
    assert fetch.main(["--preset", PRESET, "--out", str(out), "--no-download"]) == 1
    err = _error(capsys.readouterr().err)
    assert "Qwen3-1.7B-Base (Qwen/Qwen3-1.7B-Base): does not load without the hub" in err


def test_a_gated_model_is_one_line_saying_what_to_do(tmp_path, tiny_models, monkeypatch, capsys):
    import huggingface_hub

    hub = StandInHub(tiny_models, gated={"Qwen/Qwen3-4B-Base"})
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub.snapshot_download)
    assert fetch.main(["--preset", PRESET, "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert "Qwen/Qwen3-4B-Base is gated" in err and "https://huggingface.co/Qwen/Qwen3-4B-Base" in err
    assert "huggingface-cli login" in err and "HF_TOKEN" in err
    assert [c[0] for c in hub.calls] == list(MODELS.values())  # nothing after the gated one


def test_raw_files_that_give_no_training_set_are_named(tmp_path, no_network, capsys):
    out = tmp_path / "carry"
    d = fetch.DATASETS[1]  # MATH-500 only
    StandInHub({}).snapshot_download(d.repo_id, repo_type="dataset", local_dir=str(out / "raw" / d.folder),
                                     allow_patterns=list(d.files))
    assert fetch.main(["--preset", PRESET, "--out", str(out), "--no-download"]) == 1
    assert "nothing gave math_train.parquet, gsm8k_test.parquet" in _error(capsys.readouterr().err)
