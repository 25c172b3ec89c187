"""From a table row's path to a model directory: Hugging Face dirs, hub ids, trainer checkpoints (FSDP shards merged).

Why the merge is done here and not by verl's `verl.model_merger` (`FSDPModelMerger`, 0.9.1):
that merger casts every DTensor shard to bfloat16 and builds the model in bfloat16, so an fp32
checkpoint (every CPU run) would be evaluated with other weights than it trained; it needs the
`fsdp_config.json` beside the shards and stops on unsupported layouts with `assert`, not with a
message naming the checkpoint. It does handle more layouts (2-D meshes, FSDP1 flat shards), so
the error for those points to it. The merge here keeps the dtype of the model's config.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
from typing import Sequence

from recipe_hacpo.evaluation import EvalError
from recipe_hacpo.workers import verl_touchpoints as tp


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
    agents = checkpoint_agents(step_dir)
    if not agents:
        raise EvalError(f"--agents-from {spec}: no <agent>/actor folders in {step_dir} (expected a trainer checkpoint)")
    return [(f"{prefix}/{a}" if prefix else a, os.path.join(step_dir, a)) for a in agents]


def trainer_step_dir(path: str) -> str | None:
    """The `global_step_N` folder that holds `path` (`global_step_N/<agent>[/actor]`), or None
    for a path outside a trainer checkpoint."""
    parts = os.path.normpath(path).split(os.sep)
    for i in (len(parts) - 2, len(parts) - 3):
        if i >= 0 and re.fullmatch(r"global_step_\d+", parts[i]):
            return os.sep.join(parts[: i + 1]) or os.sep
    return None


def checkpoint_agents(step_dir: str) -> list[str]:
    """The agents of one `global_step_N` folder: those with an `actor/` folder, sorted."""
    return sorted(d for d in os.listdir(step_dir) if os.path.isdir(os.path.join(step_dir, d, "actor")))


def path_name(name: str) -> str:
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


# what verl writes beside the shards of a LoRA actor: {"r": rank, "lora_alpha": alpha, ...}
LORA_META_FILE = "lora_train_meta.json"
_PEFT_PREFIX = "base_model.model."


def fold_lora(state: dict, rank: int, alpha: float, actor: str = "checkpoint") -> dict:
    """A LoRA actor's merged state (peft's key names) as the plain model's state dict.

    Every adapted projection becomes W + (α / r) · B A (peft's LoRA scaling, one adapter
    named "default"); the `base_model.model.` prefix and the `.base_layer` level go.
    """
    if rank <= 0:
        raise EvalError(f"{actor}: {LORA_META_FILE} has LoRA rank {rank}")
    scale = float(alpha) / float(rank)
    plain: dict = {}
    adapters: dict[str, dict[str, object]] = {}
    for key, tensor in state.items():
        key = key[len(_PEFT_PREFIX):] if key.startswith(_PEFT_PREFIX) else key
        for part in ("lora_A", "lora_B"):
            marker = f".{part}.default.weight"
            if key.endswith(marker):
                adapters.setdefault(key[: -len(marker)], {})[part] = tensor
                break
        else:
            if ".lora_" in key:  # another adapter name, DoRA's magnitude vector, embeddings' lora_*
                raise EvalError(f"{actor}: LoRA tensor {key} is not a plain 'default' adapter; {_UNSUPPORTED.format(actor=actor)}")
            plain[key.replace(".base_layer.", ".")] = tensor
    for module, parts in adapters.items():
        weight = f"{module}.weight"
        if set(parts) != {"lora_A", "lora_B"} or weight not in plain:
            raise EvalError(f"{actor}: LoRA adapter of {module} is incomplete (has {sorted(parts)})")
        base = plain[weight]
        delta = parts["lora_B"].float() @ parts["lora_A"].float()
        plain[weight] = (base.float() + scale * delta).to(base.dtype)
    return plain


def merge_fsdp_checkpoint(actor: str, target: str, dtype: str | None = None) -> str:
    """Merge `actor/model_world_size_*_rank_*.pt` into a Hugging Face dir `target`; returns it.

    A LoRA actor (verl's `lora_train_meta.json` beside the shards) has its adapter folded into
    the base weights, so the result loads like any trained model. `dtype` (a torch dtype name)
    casts the weights and names it in config.json; None keeps the model config's dtype."""
    import json

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_dir = os.path.join(actor, tp.CHECKPOINT_HF_SUBDIR)
    files = _shard_files(actor)
    states = [torch.load(f, map_location="cpu", weights_only=False) for f in files]
    merged = merge_shards(states, actor)
    del states
    lora_meta = os.path.join(actor, LORA_META_FILE)
    if os.path.isfile(lora_meta):
        with open(lora_meta) as f:
            meta = json.load(f)
        merged = fold_lora(merged, int(meta["r"]), float(meta["lora_alpha"]), actor)
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
    if dtype is not None:
        dtype = getattr(torch, dtype)
    else:
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
    if isinstance(dtype, torch.dtype):
        config.dtype = dtype  # what from_pretrained(dtype="auto") and vLLM read
        config.save_pretrained(target)
    return target
