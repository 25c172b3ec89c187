"""Evaluate each agent's checkpoint on the math benchmarks and write the paper's Table 1.

    python -m recipe_hacpo.evaluate \\
        --checkpoint hacpo_1.7b=outputs/<pair>/checkpoints/global_step_58/qwen3_1p7b_base \\
        --checkpoint base_1.7b=/models/Qwen3-1.7B-Base \\
        --bench-dir data/paper --out eval/

`--bench-dir DIR` picks up `<name>_test.parquet` of the seven benchmarks as written by
`python -m recipe_hacpo.data.prepare --all-from RAW --out DIR`; `--bench NAME=FILE` adds or
replaces one (names: math500, math, gsm8k, aime25, amc23, minerva, olympiadbench; any other
name becomes an extra column).

Checkpoints (`--checkpoint NAME=PATH`, one table row each, in the order given; `--agents-from
[PREFIX=]DIR` adds a row for every agent of a trainer checkpoint, DIR being `global_step_N` or
the checkpoint root, whose latest step is taken):
  - a Hugging Face model dir (config.json + safetensors/bin weights), or a hub id already in
    the local Hugging Face cache;
  - a trainer checkpoint of one agent, `global_step_N/<agent>` or `global_step_N/<agent>/actor`:
    `actor/huggingface/` holds config and tokenizer (and full weights if the run saved them, which
    are then used as they are); otherwise the FSDP shards `actor/model_world_size_W_rank_R.pt`
    are merged into `<out>/models/NAME/`. Supported: FSDP2 (DTensor) shards on a 1-D device mesh,
    any W, and plain tensors when W = 1. Not supported: 2-D meshes (HSDP, tensor parallel) and
    FSDP1 flat shards — merge those with `python -m verl.model_merger merge --backend fsdp
    --local_dir .../actor --target_dir DIR` and pass DIR.

Metrics. A benchmark has P prompts; prompt i gets n samples with scores s_i1 .. s_in from
`reward.math_reward.compute_score` (1.0 correct, 0.0 not); a sample counts as correct when
s_ij >= 0.5, c_i is the number of correct samples of prompt i. For k <= n:

    avg@k  = 1/P sum_i  1/k sum_{j<=k} s_ij         mean score of the first k samples
    best@k = 1/P sum_i  max_{j<=k} s_ij             max over the first k samples, averaged over
                                                    prompts: the share of prompts solved at
                                                    least once in k tries
    pass@k = 1/P sum_i  1 - C(n - c_i, k) / C(n, k)  the unbiased estimator of Chen et al. (2021)
                                                    from n >= k samples (= best@k when n = k)

Defaults as in the paper: AIME25 best@30, every other benchmark avg@1. `--metric BENCH=SPEC`
(SPEC avg@k | best@k | pass@k) changes one; `--samples BENCH=N` draws N >= k samples.
Sampling: one sample per prompt is decoded greedily (unless `--sample-single`), several are
drawn at `--temperature` (1.0, the training temperature) and `--top-p` (1.0).

Backends: `vllm` (GPU; vLLM is imported only when this backend runs) and `hf` (Hugging Face
`generate`, CPU or GPU); `auto` takes vLLM when it is installed and a GPU is visible.
With vLLM every checkpoint runs in its own process (its engine and GPU memory are gone when
the process ends), and checkpoints are spread over the GPUs: one at a time per group of
`--tensor-parallel-size` GPUs of `--gpus` (default: every visible GPU).

Output in `--out`: `table.md` and `table.csv` (rows: checkpoints; columns: MATH-500, MATH,
GSM8K, AIME25, AMC23, Minerva, OlympiadBench — those evaluated, in this order — then extra
benchmarks, then AVG, the unweighted mean over the row's benchmarks), `metrics.json` (every
metric, prompt and sample count per checkpoint and benchmark) and
`samples/NAME/BENCH.jsonl` (every response with its score).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import gc
import glob
import importlib
import importlib.util
import json
import math
import os
import re
import shutil
import sys
import time
from typing import Callable, Protocol, Sequence

from recipe_hacpo.atomic_io import atomic_write_json
from recipe_hacpo.workers import verl_touchpoints as tp

# --------------------------------------------------------------------------- benchmarks

BENCHMARKS: tuple[tuple[str, str], ...] = (
    ("math500", "MATH-500"),
    ("math", "MATH"),
    ("gsm8k", "GSM8K"),
    ("aime25", "AIME25"),
    ("amc23", "AMC23"),
    ("minerva", "Minerva"),
    ("olympiadbench", "OlympiadBench"),
)
"""(key, Table 1 column) in the paper's column order."""

LABELS = dict(BENCHMARKS)
ALIASES = {"aime2025": "aime25", "amc2023": "amc23", "minervamath": "minerva", "olympiad": "olympiadbench"}
DEFAULT_METRICS = {"aime25": "best@30"}

MAIN_TABLE_MAX_NEW_TOKENS = 8196
"""The paper evaluates its main tables with at most 8196 new tokens per response (training
uses 4096); the number is the paper's, kept as written."""
DEFAULT_METRIC = "avg@1"
CORRECT_THRESHOLD = 0.5


class EvalError(ValueError):
    """A checkpoint, benchmark file or option that cannot be evaluated; the message is one line."""


def bench_key(name: str) -> str:
    """The canonical key of a benchmark name ("MATH-500", "math_500" -> "math500"); other names as given."""
    norm = re.sub(r"[^a-z0-9]", "", name.lower())
    norm = ALIASES.get(norm, norm)
    return norm if norm in LABELS else name


@dataclasses.dataclass(frozen=True)
class Metric:
    kind: str  # avg | best | pass
    k: int

    @classmethod
    def parse(cls, spec: str) -> "Metric":
        match = re.fullmatch(r"\s*(avg|best|pass)@(\d+)\s*", spec)
        if not match or int(match.group(2)) < 1:
            raise EvalError(f"metric {spec!r}: expected avg@k, best@k or pass@k with k >= 1")
        return cls(match.group(1), int(match.group(2)))

    def __str__(self) -> str:
        return f"{self.kind}@{self.k}"

    def compute(self, scores: Sequence[Sequence[float]]) -> float:
        return {"avg": avg_at_k, "best": best_at_k, "pass": pass_at_k}[self.kind](scores, self.k)


@dataclasses.dataclass(frozen=True)
class Benchmark:
    key: str
    path: str
    metric: Metric
    n: int  # samples drawn per prompt (>= metric.k)

    @property
    def label(self) -> str:
        return LABELS.get(self.key, self.key)


def column_order(benchmarks: Sequence[Benchmark]) -> list[Benchmark]:
    """The paper's columns first, in its order, then any other benchmark in the order given."""
    rank = {key: i for i, (key, _) in enumerate(BENCHMARKS)}
    known = sorted((b for b in benchmarks if b.key in rank), key=lambda b: rank[b.key])
    return known + [b for b in benchmarks if b.key not in rank]


def load_benchmark(path: str, limit: int | None = None) -> list[dict]:
    """Rows of a verl RL parquet file: {messages, data_source, ground_truth, extra_info}."""
    import pyarrow.parquet as pq

    if not os.path.isfile(path):
        raise EvalError(f"{path}: no such benchmark file (expected a parquet file from recipe_hacpo.data.prepare)")
    table = pq.read_table(path)
    missing = [c for c in ("prompt", "data_source", "reward_model") if c not in table.column_names]
    if missing:
        raise EvalError(f"{path}: column {missing[0]!r} missing (expected verl RL parquet: prompt, data_source, reward_model)")
    rows = []
    for i, record in enumerate(table.to_pylist()[:limit] if limit else table.to_pylist()):
        messages = record["prompt"]
        truth = (record.get("reward_model") or {}).get("ground_truth")
        if not messages or truth is None:
            raise EvalError(f"{path}: row {i}: empty prompt or no reward_model.ground_truth")
        rows.append(
            {
                "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
                "data_source": record["data_source"],
                "ground_truth": truth,
                "extra_info": record.get("extra_info"),
            }
        )
    if not rows:
        raise EvalError(f"{path}: no rows")
    return rows


# --------------------------------------------------------------------------- metrics


def _check(scores: Sequence[Sequence[float]], k: int, what: str) -> None:
    if not scores:
        raise EvalError(f"{what}: no prompts")
    short = min(len(s) for s in scores)
    if k < 1 or short < k:
        raise EvalError(f"{what}@{k}: needs k >= 1 and at least k samples per prompt, have {short}")


def avg_at_k(scores: Sequence[Sequence[float]], k: int) -> float:
    """Mean over prompts of the mean score of each prompt's first k samples."""
    _check(scores, k, "avg")
    return sum(sum(s[:k]) / k for s in scores) / len(scores)


def best_at_k(scores: Sequence[Sequence[float]], k: int) -> float:
    """Mean over prompts of the best score among each prompt's first k samples.

    The paper's AIME25 column is best@30: 30 samples per problem at temperature 1.0, a
    problem counts as solved when any of its 30 samples is correct, and the number reported
    is the share of problems solved (not the mean accuracy of the samples).
    """
    _check(scores, k, "best")
    return sum(max(s[:k]) for s in scores) / len(scores)


def pass_at_k_one(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k): the chance that k of n samples, c of them correct, hold one correct."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / j for j in range(n - c + 1, n + 1))


def pass_at_k(scores: Sequence[Sequence[float]], k: int) -> float:
    """Mean over prompts of the unbiased pass@k estimate from all of each prompt's samples."""
    _check(scores, k, "pass")
    return sum(pass_at_k_one(len(s), sum(v >= CORRECT_THRESHOLD for v in s), k) for s in scores) / len(scores)


def all_metrics(scores: Sequence[Sequence[float]], metric: Metric) -> dict[str, float]:
    """The table's metric plus avg@n, best@n and pass@1 / pass@k over all n samples."""
    n = min(len(s) for s in scores)
    out = {f"avg@{n}": avg_at_k(scores, n), f"best@{n}": best_at_k(scores, n)}
    for k in sorted({1, metric.k}):
        out[f"pass@{k}"] = pass_at_k(scores, k)
    out[str(metric)] = metric.compute(scores)
    return out


# --------------------------------------------------------------------------- checkpoints

_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
_UNSUPPORTED = (
    "merge it with `python -m verl.model_merger merge --backend fsdp --local_dir {actor} --target_dir DIR` "
    "and pass DIR"
)


def _has_hf_weights(path: str) -> bool:
    if not os.path.isfile(os.path.join(path, "config.json")):
        return False
    return bool(glob.glob(os.path.join(path, "*.safetensors")) or glob.glob(os.path.join(path, "pytorch_model*.bin")))


def resolve_checkpoint(path: str, work_dir: str) -> str:
    """A directory (or cached hub id) `from_pretrained` and vLLM can load for checkpoint `path`.

    Trainer checkpoints with FSDP shards only are merged into `work_dir` (replaced if present).
    """
    if not os.path.exists(path):
        if re.fullmatch(r"[\w.-]+/[\w.-]+", path) and _hub_cached(path):
            return path
        raise EvalError(f"{path}: no such directory, and not a hub id in the local Hugging Face cache")
    if not os.path.isdir(path):
        raise EvalError(f"{path}: not a directory (expected a Hugging Face model dir or a trainer checkpoint)")
    if _has_hf_weights(path):
        return path
    actor = path
    if not glob.glob(os.path.join(path, tp.FSDP_SHARD_GLOB)) and os.path.isdir(os.path.join(path, "actor")):
        actor = os.path.join(path, "actor")
    hf_dir = os.path.join(actor, tp.CHECKPOINT_HF_SUBDIR)
    if _has_hf_weights(hf_dir):
        return hf_dir
    shards = glob.glob(os.path.join(actor, tp.FSDP_SHARD_GLOB))
    if not shards:
        raise EvalError(
            f"{path}: neither a Hugging Face model dir (config.json and weights) nor a trainer checkpoint "
            "(global_step_N/<agent>[/actor] with huggingface/ and model_world_size_*_rank_*.pt)"
        )
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise EvalError(f"{actor}: FSDP shards without huggingface/config.json; cannot tell the architecture")
    return merge_fsdp_checkpoint(actor, work_dir)


def agent_checkpoints(spec: str) -> list[tuple[str, str]]:
    """(row name, path) for every agent of a trainer checkpoint: `[PREFIX=]DIR`, DIR a
    `global_step_N` folder or the checkpoint root (its latest_checkpointed_iteration.txt picks N)."""
    prefix, sep, path = spec.partition("=")
    if not sep:
        prefix, path = "", spec
    step_dir = path
    latest = os.path.join(path, "latest_checkpointed_iteration.txt")
    if os.path.isfile(latest):
        with open(latest) as f:
            step_dir = os.path.join(path, f"global_step_{int(f.read().strip())}")
    if not os.path.isdir(step_dir):
        raise EvalError(f"--agents-from {spec}: no such directory {step_dir}")
    agents = sorted(d for d in os.listdir(step_dir) if os.path.isdir(os.path.join(step_dir, d, "actor")))
    if not agents:
        raise EvalError(f"--agents-from {spec}: no <agent>/actor folders in {step_dir} (expected a trainer checkpoint)")
    return [(f"{prefix}/{a}" if prefix else a, os.path.join(step_dir, a)) for a in agents]


def _path_name(name: str) -> str:
    return re.sub(r"[^\w.-]+", "_", name)


def _hub_cached(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:
        return False


def _shard_files(actor: str) -> list[str]:
    found: dict[int, dict[int, str]] = {}
    for f in glob.glob(os.path.join(actor, tp.FSDP_SHARD_GLOB)):
        m = tp.FSDP_SHARD_RE.search(os.path.basename(f))
        if m:
            found.setdefault(int(m.group(1)), {})[int(m.group(2))] = f
    if len(found) != 1:
        raise EvalError(f"{actor}: shards of several world sizes {sorted(found)}; keep one checkpoint per directory")
    (world, ranks), = found.items()
    missing = sorted(set(range(world)) - set(ranks))
    if missing:
        raise EvalError(f"{actor}: world size {world} but rank {missing[0]} is missing ({tp.fsdp_shard_name(world, missing[0])})")
    return [ranks[r] for r in range(world)]


def merge_shards(states: Sequence[dict], actor: str = "checkpoint") -> dict:
    """One full state dict from the per-rank state dicts of an FSDP checkpoint (rank order).

    DTensors on a 1-D mesh: Shard(d) local tensors are concatenated along d, Replicate taken
    from rank 0. Plain tensors only for a single rank. Anything else raises `EvalError`.
    """
    import torch

    hint = _UNSUPPORTED.format(actor=actor)
    merged = {}
    for key, first in states[0].items():
        values = [s[key] for s in states]
        if hasattr(first, "to_local") and hasattr(first, "placements"):
            placements = tuple(first.placements)
            if len(placements) != 1:
                raise EvalError(f"{actor}: {key} is sharded over a {len(placements)}-D device mesh (HSDP / tensor parallel), not supported; {hint}")
            place = placements[0]
            local = [v.to_local() for v in values]
            if place.is_shard():
                tensor = torch.cat(local, dim=place.dim) if len(local) > 1 else local[0]
            elif place.is_replicate():
                tensor = local[0]
            else:
                raise EvalError(f"{actor}: {key} has placement {place}, not supported; {hint}")
            if tuple(tensor.shape) != tuple(first.shape):
                raise EvalError(f"{actor}: {key}: merged shape {tuple(tensor.shape)} != {tuple(first.shape)}; {hint}")
        elif isinstance(first, torch.Tensor):
            if len(states) > 1:
                raise EvalError(f"{actor}: {key} is a plain tensor in a {len(states)}-rank checkpoint (FSDP1 flat shards), not supported; {hint}")
            tensor = first
        else:
            continue
        merged[_clean_key(key)] = tensor.detach().cpu()
    return merged


def _clean_key(key: str) -> str:
    for part in _WRAPPER_PARTS:
        key = key.replace(part, "")
    return key


def merge_fsdp_checkpoint(actor: str, target: str) -> str:
    """Merge `actor/model_world_size_*_rank_*.pt` into a Hugging Face dir `target`; returns it."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_dir = os.path.join(actor, tp.CHECKPOINT_HF_SUBDIR)
    files = _shard_files(actor)
    states = [torch.load(f, map_location="cpu", weights_only=False) for f in files]
    merged = merge_shards(states, actor)
    del states
    config = AutoConfig.from_pretrained(hf_dir)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    expected = set(skeleton.state_dict())
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied:
        merged.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    missing, unexpected = sorted(expected - set(merged)), sorted(set(merged) - expected)
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise EvalError(f"{actor}: merged weights do not fit {type(skeleton).__name__} ({what}); {_UNSUPPORTED.format(actor=actor)}")
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        merged = {k: v.to(dtype) if v.is_floating_point() else v for k, v in merged.items()}

    shutil.rmtree(target, ignore_errors=True)
    os.makedirs(target)
    for name in os.listdir(hf_dir):
        src = os.path.join(hf_dir, name)
        if os.path.isfile(src) and not name.endswith((".safetensors", ".bin")) and name != "model.safetensors.index.json":
            shutil.copy2(src, os.path.join(target, name))
    save_file({k: v.contiguous() for k, v in merged.items()}, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    return target


# --------------------------------------------------------------------------- generation


@dataclasses.dataclass(frozen=True)
class GenOptions:
    backend: str = "auto"
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = MAIN_TABLE_MAX_NEW_TOKENS
    max_prompt_length: int = 2048
    sample_single: bool = False
    batch_size: int = 16
    dtype: str = "auto"
    device: str | None = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.85
    seed: int = 0
    chat_template_kwargs: tuple[tuple[str, object], ...] = ()


class Generator(Protocol):
    def generate(self, prompts: Sequence[list[dict]], n: int, temperature: float, seed: int) -> list[list[str]]:
        """`n` responses (decoded text) for every chat prompt, in prompt order."""

    def close(self) -> None: ...


def _chat_ids(tokenizer, messages: list[dict], template_kwargs: tuple = ()) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **dict(template_kwargs))
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class HFGenerator:
    """Hugging Face `generate`, left-padded batches of prompts, `n` return sequences each."""

    def __init__(self, model_dir: str, opts: GenOptions):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = opts.dtype
        if dtype == "auto":
            dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir)
        self.model.to(device=self.device, dtype=getattr(torch, dtype)).eval()
        from recipe_hacpo.exchange import eos_token_ids

        self.eos = eos_token_ids(model_dir, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad = pad if pad is not None else (self.eos[0] if self.eos else 0)
        self.opts = opts

    def generate(self, prompts, n, temperature, seed):
        import torch

        torch.manual_seed(seed)
        out: list[list[str]] = []
        for start in range(0, len(prompts), self.opts.batch_size):
            batch = prompts[start : start + self.opts.batch_size]
            ids = [_chat_ids(self.tokenizer, m, self.opts.chat_template_kwargs) for m in batch]
            width = max(len(x) for x in ids)
            input_ids = torch.tensor([[self.pad] * (width - len(x)) + x for x in ids], device=self.device)
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=self.device)
            sampling = {"do_sample": True, "temperature": temperature, "top_p": self.opts.top_p} if temperature > 0 else {"do_sample": False}
            with torch.no_grad():
                seqs = self.model.generate(
                    input_ids=input_ids,
                    attention_mask=mask,
                    max_new_tokens=self.opts.max_new_tokens,
                    num_return_sequences=n,
                    eos_token_id=self.eos or None,
                    pad_token_id=self.pad,
                    **sampling,
                )
            new = seqs[:, width:].tolist()
            for i in range(len(ids)):
                out.append([self._decode(row) for row in new[i * n : (i + 1) * n]])
        return out

    def _decode(self, tokens: list[int]) -> str:
        for j, t in enumerate(tokens):
            if t in self.eos:
                tokens = tokens[:j]
                break
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def close(self):
        self.model = None
        gc.collect()


class VLLMGenerator:
    """vLLM offline inference (GPU); vLLM is imported here and nowhere else."""

    def __init__(self, model_dir: str, opts: GenOptions):
        import vllm
        from transformers import AutoTokenizer

        self.vllm = vllm
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.llm = vllm.LLM(
            model=model_dir,
            tensor_parallel_size=opts.tensor_parallel_size,
            gpu_memory_utilization=opts.gpu_memory_utilization,
            max_model_len=opts.max_prompt_length + opts.max_new_tokens,
            dtype="bfloat16" if opts.dtype == "auto" else opts.dtype,
            seed=opts.seed,
        )
        self.opts = opts

    def generate(self, prompts, n, temperature, seed):
        params = self.vllm.SamplingParams(
            n=n,
            temperature=temperature,
            top_p=self.opts.top_p if temperature > 0 else 1.0,
            max_tokens=self.opts.max_new_tokens,
            seed=seed,
        )
        inputs = [{"prompt_token_ids": _chat_ids(self.tokenizer, m, self.opts.chat_template_kwargs)} for m in prompts]
        too_long = [i for i, x in enumerate(inputs) if len(x["prompt_token_ids"]) > self.opts.max_prompt_length]
        if too_long:
            raise EvalError(
                f"prompt {too_long[0]} has {len(inputs[too_long[0]]['prompt_token_ids'])} tokens, over "
                f"--max-prompt-length {self.opts.max_prompt_length}; raise it"
            )
        results = self.llm.generate(inputs, params, use_tqdm=True)
        return [[c.text for c in r.outputs] for r in results]

    def close(self):
        shutdown_vllm(self.llm)
        self.llm = None
        gc.collect()
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def shutdown_vllm(llm) -> None:
    """Stop an offline `vllm.LLM`'s engine: its engine-core process holds the GPU memory
    (weights, KV cache) until it is shut down, and dropping the Python object does not
    reliably do that. Best effort: evaluation also runs each vLLM engine in its own process."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    for target in (core, engine):
        shutdown = getattr(target, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except Exception:  # already stopped, or a vLLM without it: the process exit frees it
                pass
            return


def pick_backend(backend: str) -> str:
    if backend not in ("auto", "vllm", "hf"):
        raise EvalError(f"--backend {backend}: expected auto, vllm or hf")
    if backend != "auto":
        if backend == "vllm" and importlib.util.find_spec("vllm") is None:
            raise EvalError("--backend vllm: vllm is not installed (pip install 'recipe-hacpo[gpu]'); or use --backend hf")
        return backend
    import torch

    return "vllm" if importlib.util.find_spec("vllm") is not None and torch.cuda.is_available() else "hf"


def make_generator(backend: str, model_dir: str, opts: GenOptions) -> Generator:
    return VLLMGenerator(model_dir, opts) if backend == "vllm" else HFGenerator(model_dir, opts)


def gpu_groups(gpus: str | None, tensor_parallel_size: int) -> list[str]:
    """CUDA_VISIBLE_DEVICES values, one per checkpoint evaluated at a time: the GPUs in
    consecutive groups of `tensor_parallel_size`. `gpus`: "0,1,2,3", or None for every GPU
    this process sees."""
    if gpus is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            ids = [g for g in visible.split(",") if g.strip()]
        else:
            import torch

            ids = [str(i) for i in range(torch.cuda.device_count())]
    else:
        ids = [g.strip() for g in gpus.split(",") if g.strip()]
    if not ids:
        return []
    tp = max(1, tensor_parallel_size)
    if len(ids) % tp:
        raise EvalError(f"--gpus {','.join(ids)}: {len(ids)} GPUs do not split into groups of --tensor-parallel-size {tp}")
    return [",".join(ids[i : i + tp]) for i in range(0, len(ids), tp)]


# --------------------------------------------------------------------------- evaluation


def _load_compute_score() -> Callable:
    from recipe_hacpo.reward.math_reward import compute_score

    return compute_score


def score_responses(rows: Sequence[dict], responses: Sequence[Sequence[str]], compute_score: Callable) -> list[list[float]]:
    scores = []
    for row, texts in zip(rows, responses):
        prompt_scores = []
        for text in texts:
            result = compute_score(
                data_source=row["data_source"], solution_str=text, ground_truth=row["ground_truth"], extra_info=row["extra_info"]
            )
            prompt_scores.append(float(result["score"] if isinstance(result, dict) else result))
        scores.append(prompt_scores)
    return scores


def evaluate(
    checkpoints: Sequence[tuple[str, str]],
    benchmarks: Sequence[Benchmark],
    out_dir: str,
    opts: GenOptions,
    limit: int | None = None,
    log: Callable[[str], None] = print,
    gpus: str | None = None,
    isolate: bool | None = None,
) -> dict:
    """Generate, score and summarise; returns {checkpoint: {bench key: metrics}} (also in metrics.json).

    With `isolate` (default: for the vllm backend) every checkpoint is evaluated in its own
    process, so its vLLM engine and GPU memory are gone when the next one starts, and up to
    one checkpoint per GPU group (`gpu_groups`) runs at a time. Without it, checkpoints run
    one after another in this process.
    """
    backend = pick_backend(opts.backend)
    data = {b.key: load_benchmark(b.path, limit) for b in benchmarks}
    results: dict[str, dict] = {}
    os.makedirs(out_dir, exist_ok=True)
    # trainer checkpoints are merged here, once, before any generation
    jobs = [(name, resolve_checkpoint(path, os.path.join(out_dir, "models", _path_name(name)))) for name, path in checkpoints]
    if isolate is None:
        isolate = backend == "vllm"

    def done(name: str, per_bench: dict) -> None:
        results[name] = per_bench
        # kept current, so an interrupted run keeps what it finished
        atomic_write_json(os.path.join(out_dir, "metrics.json"), results)

    if isolate:
        groups = gpu_groups(gpus, opts.tensor_parallel_size) or [None]
        _run_isolated(jobs, groups, (benchmarks, data, out_dir, opts, backend), done, log)
        # table order follows the command line, not completion order
        ordered = {name: results[name] for name, _ in jobs}
        results.clear()
        results.update(ordered)
    else:
        compute_score = _load_compute_score()
        for name, model_dir in jobs:
            done(name, evaluate_checkpoint(name, model_dir, benchmarks, data, out_dir, opts, backend, compute_score, log))
    atomic_write_json(os.path.join(out_dir, "metrics.json"), results)
    return results


def evaluate_checkpoint(
    name: str,
    model_dir: str,
    benchmarks: Sequence[Benchmark],
    data: dict,
    out_dir: str,
    opts: GenOptions,
    backend: str,
    compute_score: Callable,
    log: Callable[[str], None] = print,
) -> dict:
    """One checkpoint on every benchmark: {bench key: metrics}; its samples go to out_dir/samples."""
    log(f"[{name}] {model_dir} ({backend})")
    generator = make_generator(backend, model_dir, opts)
    results: dict[str, dict] = {}
    try:
        for bench in benchmarks:
            rows = data[bench.key]
            greedy = bench.n == 1 and not opts.sample_single
            temperature = 0.0 if greedy else opts.temperature
            if temperature <= 0 and bench.n > 1:
                raise EvalError(f"{bench.key}: {bench.n} samples per prompt need --temperature > 0")
            start = time.monotonic()
            responses = generator.generate([r["messages"] for r in rows], bench.n, temperature, opts.seed)
            if len(responses) != len(rows) or any(len(r) != bench.n for r in responses):
                raise EvalError(f"{bench.key}: the generator returned the wrong number of responses")
            scores = score_responses(rows, responses, compute_score)
            metrics = all_metrics(scores, bench.metric)
            results[bench.key] = {
                "metric": str(bench.metric),
                "value": metrics[str(bench.metric)],
                "metrics": metrics,
                "prompts": len(rows),
                "samples_per_prompt": bench.n,
                "temperature": temperature,
                "file": bench.path,
            }
            _write_samples(
                os.path.join(out_dir, "samples", _path_name(name), f"{_path_name(bench.key)}.jsonl"), rows, responses, scores
            )
            log(f"[{name}] {bench.label}: {bench.metric} = {metrics[str(bench.metric)]:.4f} ({len(rows)} prompts, {time.monotonic() - start:.0f} s)")
    finally:
        generator.close()
    return results


def _checkpoint_process(name, model_dir, shared, queue) -> None:
    """Body of one checkpoint's process: evaluate, send (name, ok, result or error line), exit."""
    benchmarks, data, out_dir, opts, backend = shared
    try:
        result = evaluate_checkpoint(name, model_dir, benchmarks, data, out_dir, opts, backend, _load_compute_score(),
                                     lambda msg: print(msg, flush=True))
        queue.put((name, True, result))
    except BaseException as e:  # reported by the parent as one line naming the checkpoint
        first = (str(e).strip().splitlines() or [""])[0]
        queue.put((name, False, f"{type(e).__name__}: {first}"))


# how often the parent looks for a checkpoint process that died without reporting (seconds)
_POLL_S = 2.0


def _run_isolated(jobs, groups, shared, done, log) -> None:
    """Run `_checkpoint_process` per job, at most one per GPU group at a time (spawned, so no
    CUDA state is inherited); CUDA_VISIBLE_DEVICES is the job's group."""
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")
    # by reference to the importable module, also when this file runs as `python -m` (__main__)
    target = importlib.import_module("recipe_hacpo.evaluate")._checkpoint_process
    results = ctx.Queue()
    pending, free = list(jobs), list(groups)
    running: dict[str, tuple] = {}
    try:
        while pending or running:
            while pending and free:
                (name, model_dir), group = pending.pop(0), free.pop(0)
                saved = os.environ.get("CUDA_VISIBLE_DEVICES")
                if group is not None:
                    os.environ["CUDA_VISIBLE_DEVICES"] = group
                    log(f"[{name}] on GPU(s) {group}")
                try:
                    proc = ctx.Process(target=target, args=(name, model_dir, shared, results), daemon=False)
                    proc.start()
                finally:
                    if saved is None:
                        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                    else:
                        os.environ["CUDA_VISIBLE_DEVICES"] = saved
                running[name] = (proc, group)
            try:
                name, ok, payload = results.get(timeout=_POLL_S)
            except queue_mod.Empty:
                dead = [(n, p.exitcode) for n, (p, _) in running.items() if not p.is_alive()]
                if dead:
                    n, code = dead[0]
                    raise EvalError(f"checkpoint {n}: its evaluation process exited with code {code} without a result")
                continue
            proc, group = running.pop(name)
            proc.join()
            free.append(group)
            if not ok:
                raise EvalError(f"checkpoint {name}: {payload}")
            done(name, payload)
    finally:
        for proc, _ in running.values():
            proc.terminate()
            proc.join()


def _write_samples(path: str, rows, responses, scores) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i, (row, texts, values) in enumerate(zip(rows, responses, scores)):
            record = {
                "index": i,
                "data_source": row["data_source"],
                "ground_truth": row["ground_truth"],
                "prompt": row["messages"][-1]["content"],
                "responses": list(texts),
                "scores": values,
            }
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------- Table 1


def table_rows(results: dict, benchmarks: Sequence[Benchmark]) -> tuple[list[str], list[list]]:
    """Header and rows of Table 1: one row per checkpoint, benchmark columns, then AVG."""
    cols = column_order(benchmarks)
    header = ["Method"] + [b.label for b in cols] + ["AVG"]
    rows = []
    for name, per_bench in results.items():
        values = [per_bench[b.key]["value"] for b in cols]
        rows.append([name] + values + [sum(values) / len(values)])
    return header, rows


def format_markdown(results: dict, benchmarks: Sequence[Benchmark], percent: bool = False) -> str:
    header, rows = table_rows(results, benchmarks)
    fmt = (lambda v: f"{100 * v:.1f}") if percent else (lambda v: f"{v:.3f}")
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join([" --- "] + [" ---: "] * (len(header) - 1)) + "|",
    ]
    lines += ["| " + " | ".join([r[0]] + [fmt(v) for v in r[1:]]) + " |" for r in rows]
    cols = column_order(benchmarks)
    note = ", ".join(f"{b.label} {b.metric}" for b in cols)
    lines += ["", f"Metrics: {note}. AVG: unweighted mean over the {len(cols)} benchmarks."]
    return "\n".join(lines) + "\n"


def write_tables(results: dict, benchmarks: Sequence[Benchmark], out_dir: str, percent: bool = False) -> tuple[str, str]:
    md_path, csv_path = os.path.join(out_dir, "table.md"), os.path.join(out_dir, "table.csv")
    with open(md_path, "w") as f:
        f.write(format_markdown(results, benchmarks, percent))
    header, rows = table_rows(results, benchmarks)
    with open(csv_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for r in rows:
            writer.writerow([r[0]] + [f"{v:.6f}" for v in r[1:]])
    return md_path, csv_path


# --------------------------------------------------------------------------- command line


def _pairs(values: Sequence[str] | None, flag: str) -> list[tuple[str, str]]:
    out = []
    for value in values or []:
        name, sep, rest = value.partition("=")
        if not sep or not name.strip() or not rest.strip():
            raise EvalError(f"{flag} {value!r}: expected NAME=VALUE")
        out.append((name.strip(), rest.strip()))
    return out


def build_benchmarks(
    bench_args: Sequence[str] | None,
    bench_dir: str | None,
    metric_args: Sequence[str] | None,
    sample_args: Sequence[str] | None,
) -> list[Benchmark]:
    files: dict[str, str] = {}
    if bench_dir:
        if not os.path.isdir(bench_dir):
            raise EvalError(f"--bench-dir {bench_dir}: no such directory")
        for key, _ in BENCHMARKS:
            path = os.path.join(bench_dir, f"{key}_test.parquet")
            if os.path.isfile(path):
                files[key] = path
        if not files:
            raise EvalError(f"--bench-dir {bench_dir}: no <benchmark>_test.parquet files ({', '.join(k for k, _ in BENCHMARKS)})")
    for name, path in _pairs(bench_args, "--bench"):
        files[bench_key(name)] = path
    if not files:
        raise EvalError("no benchmarks: give --bench NAME=FILE or --bench-dir DIR")
    metrics = {bench_key(k): Metric.parse(v) for k, v in _pairs(metric_args, "--metric")}
    samples = {}
    for k, v in _pairs(sample_args, "--samples"):
        if not v.isdigit() or int(v) < 1:
            raise EvalError(f"--samples {k}={v}: expected a positive integer")
        samples[bench_key(k)] = int(v)
    for key in list(metrics) + list(samples):
        if key not in files:
            raise EvalError(f"{key}: a metric or sample count for a benchmark that is not evaluated ({', '.join(files)})")
    out = []
    for key, path in files.items():
        metric = metrics.get(key) or Metric.parse(DEFAULT_METRICS.get(key, DEFAULT_METRIC))
        n = samples.get(key, metric.k)
        if n < metric.k:
            raise EvalError(f"--samples {key}={n}: fewer than the k of {metric}")
        out.append(Benchmark(key, path, metric, n))
    return column_order(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recipe_hacpo.evaluate",
        description="Evaluate checkpoints on math benchmarks; write Table 1 (markdown + CSV).",
    )
    parser.add_argument("--checkpoint", action="append", metavar="NAME=PATH", help="a table row (repeat)")
    parser.add_argument(
        "--agents-from", action="append", metavar="[PREFIX=]DIR",
        help="one row per agent of a trainer checkpoint (global_step_N, or the root: latest step)",
    )
    parser.add_argument("--bench", action="append", metavar="NAME=FILE", help="a benchmark parquet file (repeat)")
    parser.add_argument("--bench-dir", help="pick up <benchmark>_test.parquet files from recipe_hacpo.data.prepare")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--metric", action="append", metavar="BENCH=SPEC", help="avg@k | best@k | pass@k (default: aime25 best@30, else avg@1)")
    parser.add_argument("--samples", action="append", metavar="BENCH=N", help="samples per prompt (default: the metric's k)")
    parser.add_argument("--backend", default="auto", help="auto | vllm | hf")
    parser.add_argument("--temperature", type=float, default=1.0, help="when sampling several responses")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--sample-single", action="store_true", help="sample (not greedy) when one response per prompt")
    parser.add_argument(
        "--max-new-tokens", type=int, default=MAIN_TABLE_MAX_NEW_TOKENS,
        help=f"generation limit per response (default {MAIN_TABLE_MAX_NEW_TOKENS}, the paper's main tables)",
    )
    parser.add_argument("--max-prompt-length", type=int, default=2048, help="vLLM context = this + --max-new-tokens")
    parser.add_argument("--limit", type=int, help="first N prompts of every benchmark (smoke tests)")
    parser.add_argument("--batch-size", type=int, default=16, help="hf: prompts per generate call")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU) | bfloat16 | float16 | float32")
    parser.add_argument("--device", help="hf: cpu | cuda[:i] (default: cuda when available)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="vllm")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="vllm")
    parser.add_argument(
        "--isolate", action=argparse.BooleanOptionalAction, default=None,
        help="evaluate every checkpoint in its own process (default: yes with vllm, no with hf)",
    )
    parser.add_argument(
        "--gpus", metavar="IDS",
        help="vllm: GPU ids to spread checkpoints over, e.g. 0,1,2,3: one checkpoint per group of "
        "--tensor-parallel-size GPUs at a time, each in its own process (default: every visible GPU)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--chat-template-kwargs", default="{}", metavar="JSON",
        help='extra chat template arguments, as in training (e.g. \'{"enable_thinking": false}\')',
    )
    parser.add_argument("--percent", action="store_true", help="markdown values as percentages")
    args = parser.parse_args(argv)
    try:
        checkpoints = _pairs(args.checkpoint, "--checkpoint")
        for spec in args.agents_from or []:
            checkpoints += agent_checkpoints(spec)
        if not checkpoints:
            raise EvalError("nothing to evaluate: give --checkpoint NAME=PATH or --agents-from DIR")
        names = [n for n, _ in checkpoints]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup:
            raise EvalError(f"--checkpoint {dup}: name given twice")
        if args.limit is not None and args.limit < 1:
            raise EvalError("--limit must be >= 1")
        if args.max_new_tokens < 1 or args.batch_size < 1:
            raise EvalError("--max-new-tokens and --batch-size must be >= 1")
        benchmarks = build_benchmarks(args.bench, args.bench_dir, args.metric, args.samples)
        try:
            template_kwargs = json.loads(args.chat_template_kwargs)
        except json.JSONDecodeError as e:
            raise EvalError(f"--chat-template-kwargs: not JSON ({e.msg})") from None
        if not isinstance(template_kwargs, dict):
            raise EvalError("--chat-template-kwargs: expected a JSON object")
        opts = GenOptions(
            backend=args.backend,
            temperature=args.temperature,
            top_p=args.top_p,
            max_new_tokens=args.max_new_tokens,
            max_prompt_length=args.max_prompt_length,
            sample_single=args.sample_single,
            batch_size=args.batch_size,
            dtype=args.dtype,
            device=args.device,
            tensor_parallel_size=args.tensor_parallel_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            seed=args.seed,
            chat_template_kwargs=tuple(template_kwargs.items()),
        )
        results = evaluate(checkpoints, benchmarks, args.out, opts, limit=args.limit, gpus=args.gpus, isolate=args.isolate)
    except EvalError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    md_path, csv_path = write_tables(results, benchmarks, args.out, args.percent)
    with open(md_path) as f:
        print(f.read(), end="")
    print(f"wrote {md_path}, {csv_path}, {os.path.join(args.out, 'metrics.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
