"""Supervised warm start of a tiny agent on a synthetic arithmetic task.

The agent is trained on exactly the token sequence its rollout will see: the prompt rendered
with its own chat template (`apply_chat_template(messages, add_generation_prompt=True)`),
followed by the answer and EOS; the loss covers the answer and EOS tokens only. The result is
a Hugging Face directory (model, tokenizer, generation config) that verl loads through
`model_path`.

    python -m recipe_hacpo.warm_start --kind qwen2-char-small --task add3 --steps 1000 --out DIR --seed 0

prints the held-out greedy accuracy. Same arguments, same weights (single process, fixed seed).
A directory whose record matches the arguments is reused as is.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Sequence

import torch

from recipe_hacpo import quiet  # noqa: F401  (no model load/save progress bars unless HACPO_VERBOSE=1)
from recipe_hacpo import tiny_agents
from recipe_hacpo.atomic_io import replace_dir, staging_dir
from recipe_hacpo.data import synthetic

RECORD_FILE = "warm_start.json"
_VERSION = 1


@dataclass(frozen=True)
class WarmStartArgs:
    kind: str
    task: str = "add3"
    steps: int = 1000
    seed: int = 0
    lr: float = 2e-3
    batch_size: int = 128
    n_train: int = 50_000
    n_eval: int = 1024
    eval_seed: int = 0
    init: str = ""  # continue from this warmed agent directory instead of the kind's random init
    # True: of the token embedding (and a tied output layer) only the rows of the tokens the task's
    # sequences use are trained; every other row keeps its seeded random init. A warm start of a
    # 128k-152k-id agent then differs from its init in ~100k numbers (`save_trained_state`), which
    # a repository can keep instead of the whole model.
    task_rows_only: bool = False


# --------------------------------------------------------------------------- data
def encode_rows(tokenizer, rows: Sequence[dict]) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, answer ids + EOS) per row, the prompt rendered by the agent's chat template."""
    prompts, answers = [], []
    for row in rows:
        ids = tokenizer.apply_chat_template(list(row["prompt"]), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        prompts.append(list(ids))
        truth = row["reward_model"]["ground_truth"]
        answers.append(tokenizer.encode(truth, add_special_tokens=False) + [tokenizer.eos_token_id])
    return prompts, answers


def make_batch(prompts, answers, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input ids, attention mask, and labels that are -100 outside answer + EOS."""
    seqs = [p + a for p, a in zip(prompts, answers)]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        n = len(p) + len(a)
        ids[i, :n] = torch.tensor(p + a)
        mask[i, :n] = 1
        labels[i, len(p):n] = torch.tensor(a)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


# Above this vocabulary size the output layer is applied to the labelled positions only: the
# real tokenizers' 128k-152k ids make full-sequence logits cost ten times the rest of the model.
# The loss is the same mean over the same tokens; the tiny kinds' small vocabularies keep the
# full-logits path their shipped warm starts were trained with.
SPARSE_LOGITS_MIN_VOCAB = 4096


def sft_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if model.config.vocab_size >= SPARSE_LOGITS_MIN_VOCAB:
        hidden = model.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        labels = batch["labels"][:, 1:]
        keep = labels != -100
        logits = model.get_output_embeddings()(hidden.last_hidden_state[:, :-1][keep]).float()
        return torch.nn.functional.cross_entropy(logits, labels[keep])
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    shift_logits = logits[:, :-1].float()
    shift_labels = batch["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(
        shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1), ignore_index=-100
    )


# --------------------------------------------------------------------------- evaluation
def answer_matches(text: str, truth: str) -> bool:
    """The trainer's rule for `hacpo/arith/*`: the last integer of the response equals the truth string."""
    import re

    found = re.findall(r"-?\d+", text or "")
    return bool(found) and found[-1] == str(truth).strip()


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows: Sequence[dict], *, batch_size: int = 256, max_new_tokens: int = 8) -> float:
    """Greedy held-out accuracy: left-padded prompts, argmax decoding until EOS."""
    model.eval()
    prompts, _ = encode_rows(tokenizer, rows)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    correct = 0
    for start in range(0, len(rows), batch_size):
        chunk = prompts[start:start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, p in enumerate(chunk):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=eos, pad_token_id=pad,
        )
        for i, row in enumerate(rows[start:start + batch_size]):
            gen = out[i, width:].tolist()
            if eos in gen:
                gen = gen[: gen.index(eos)]
            text = tokenizer.decode(gen, skip_special_tokens=True)
            correct += answer_matches(text, row["reward_model"]["ground_truth"])
    return correct / max(1, len(rows))


def held_out_rows(task: str, n: int, seed: int = 0) -> list[dict]:
    return synthetic.generate(task, "test", n, seed)


# --------------------------------------------------------------------------- training
def _record(args: WarmStartArgs) -> dict:
    record = {"version": _VERSION, **asdict(args)}
    if not args.task_rows_only:
        del record["task_rows_only"]  # as recorded before the option existed (the shipped agents)
    return record


def _identity(record: dict, parent: dict | None = None) -> dict:
    """What makes two warm starts the same agent: their arguments, with `init` standing for the
    parent agent's own identity rather than the folder it lies in (so a shipped or moved chain of
    agents is reused wherever it is copied to)."""
    defaults = asdict(WarmStartArgs(kind=record.get("kind", "")))
    out = {k: record.get(k, defaults.get(k)) for k in ("version", *defaults) if k != "init"}
    parent = parent if parent is not None else record.get("init_record")
    out["init"] = _identity(parent) if record.get("init") and parent else None
    return out


def load_record(out: str) -> dict | None:
    try:
        with open(os.path.join(out, RECORD_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def reusable(args: WarmStartArgs, out: str) -> dict | None:
    """The record of the agent already in `out` when it is the one `args` would train, else None."""
    existing = load_record(out)
    if existing and _identity(existing) == _identity(_record(args), load_record(args.init) if args.init else None):
        return existing
    return None


def warm_start(args: WarmStartArgs, out: str, *, log_every: int = 100, verbose: bool = True) -> dict:
    """Train `args.kind` from its seeded random init; write the agent to `out`; return its record.
    An agent already in `out` that these arguments would make is kept as it is."""
    existing = reusable(args, out)
    if existing:
        return existing
    record = _record(args)

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    with tempfile.TemporaryDirectory() as base_dir:
        if args.init:
            parent = load_record(args.init)
            if not parent or parent.get("kind") != args.kind:
                raise ValueError(f"--init {args.init}: not a warmed {args.kind} agent")
            base = args.init
        else:
            base = tiny_agents.build_agent(base_dir, args.kind, args.seed)
        tokenizer = AutoTokenizer.from_pretrained(base)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        gen_config = GenerationConfig.from_pretrained(base)

    train_rows = synthetic.generate(args.task, "train", args.n_train, 1000 + args.seed)
    eval_rows = held_out_rows(args.task, args.n_eval, args.eval_seed)
    prompts, answers = encode_rows(tokenizer, train_rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    if args.task_rows_only:
        used = torch.zeros(model.get_input_embeddings().weight.shape[0], 1)
        used[sorted({t for seq in (*prompts, *answers) for t in seq} | {pad})] = 1.0
        embeddings = (model.get_input_embeddings().weight, model.get_output_embeddings().weight)
        for weight in {id(w): w for w in embeddings}.values():
            # a zero gradient leaves Adam's moments at zero: the row does not move
            weight.register_hook(lambda grad: grad * used)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(prompts), generator=gen).tolist()
    cursor = 0
    start = time.perf_counter()
    history = []
    model.train()
    for step in range(1, args.steps + 1):
        if cursor + args.batch_size > len(order):
            order = torch.randperm(len(prompts), generator=gen).tolist()
            cursor = 0
        idx = order[cursor:cursor + args.batch_size]
        cursor += args.batch_size
        batch = make_batch([prompts[i] for i in idx], [answers[i] for i in idx], pad)
        loss = sft_loss(model, batch)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        if log_every and (step % log_every == 0 or step == args.steps):
            history.append({"step": step, "loss": float(loss.detach())})
            if verbose:
                print(f"[{args.kind}] step {step}/{args.steps} loss {float(loss.detach()):.4f}", flush=True)
    train_s = time.perf_counter() - start
    accuracy = greedy_accuracy(model, tokenizer, eval_rows)
    model.eval()

    if args.init:
        record["init_record"] = {k: v for k, v in load_record(args.init).items() if k != "loss_history"}
        record["total_steps"] = record["init_record"].get("total_steps", record["init_record"]["steps"]) + args.steps
    else:
        record["total_steps"] = args.steps
    record.update({"held_out_accuracy": accuracy, "train_seconds": train_s, "loss_history": history,
                   "params": sum(p.numel() for p in model.parameters())})
    parent = os.path.dirname(os.path.abspath(out)) or "."
    with staging_dir(parent, prefix=".warm.") as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        gen_config.save_pretrained(tmp)
        with open(os.path.join(tmp, RECORD_FILE), "w") as f:
            json.dump(record, f, indent=2)
        replace_dir(tmp, out)
    return record


# --------------------------------------------------------------------------- a warm start kept as a state
_ROWS = ".rows"  # the row indices of a tensor kept by its changed rows only


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def save_trained_state(agent_dir: str, path: str) -> None:
    """What the warm start in `agent_dir` changed in its kind's seeded init, as one safetensors
    file: each tensor whole, or by its changed rows when fewer than half changed (a
    `task_rows_only` embedding). Why: training is chaotic enough that the last-bit differences of
    two CPUs' kernels grow into other weights within a hundred steps, while the seeded init is
    the same everywhere; `restore_trained_state` rebuilds these exact bits on any machine."""
    from safetensors.torch import load_file, save_file

    record = load_record(agent_dir)
    if not record or record.get("init"):
        raise ValueError(f"{agent_dir}: not a warm start from a seeded init (no {RECORD_FILE}, or continued from another)")
    with tempfile.TemporaryDirectory() as tmp:
        init = load_file(os.path.join(tiny_agents.build_agent(tmp, record["kind"], record["seed"]), "model.safetensors"))
    state = {}
    for name, tensor in load_file(os.path.join(agent_dir, "model.safetensors")).items():
        changed = (tensor != init[name]).reshape(len(tensor), -1).any(1).nonzero().flatten() if tensor.dim() >= 2 else None
        if changed is not None and len(changed) < len(tensor) // 2:
            state[name], state[name + _ROWS] = tensor[changed].contiguous(), changed
        else:
            state[name] = tensor
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file(state, path, metadata={"record": json.dumps(record), "init": _digest(init)})


def restore_trained_state(path: str, out: str) -> dict:
    """The warm-started agent of `save_trained_state`'s file, rebuilt in `out`; returns its record.
    Fails when the seeded init built here is not the one the state was taken over."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(path, "pt") as f:
        meta = f.metadata()
        state = {name: f.get_tensor(name) for name in f.keys()}
    record = json.loads(meta["record"])
    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, staging_dir(parent, prefix=".warm.") as staged:
        base = tiny_agents.build_agent(tmp, record["kind"], record["seed"])
        weights = load_file(os.path.join(base, "model.safetensors"))
        if _digest(weights) != meta["init"]:
            raise ValueError(f"{path}: the seeded init of {record['kind']} built here differs from the one the state was taken over")
        for name, tensor in state.items():
            if name.endswith(_ROWS):
                continue
            if name + _ROWS in state:
                weights[name][state[name + _ROWS]] = tensor
            else:
                weights[name] = tensor
        for entry in os.listdir(base):
            if entry not in ("model.safetensors", tiny_agents.SPEC_FILE):
                shutil.copy2(os.path.join(base, entry), staged)
        save_file(weights, os.path.join(staged, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(staged, RECORD_FILE), "w") as f:
            json.dump(record, f, indent=2)
        replace_dir(staged, out)
    return record


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Supervised warm start of a tiny agent (loss on answer + EOS).")
    p.add_argument("--kind", required=True, choices=sorted(tiny_agents.ALL_KINDS))
    p.add_argument("--task", default="add3", choices=sorted(synthetic.KINDS))
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--n-train", type=int, default=50_000)
    p.add_argument("--n-eval", type=int, default=1024)
    p.add_argument("--init", default="", help="continue from this warmed agent directory (same kind)")
    a = p.parse_args(argv)
    args = WarmStartArgs(kind=a.kind, task=a.task, steps=a.steps, seed=a.seed, lr=a.lr, batch_size=a.batch_size,
                         n_train=a.n_train, n_eval=a.n_eval, init=os.path.abspath(a.init) if a.init else "")
    reused = reusable(args, a.out)
    rec = reused or warm_start(args, a.out)
    # a reused agent's seconds are those it took when it was made, not this run's
    how = (f"reused as is (its {args.steps} steps took {rec['train_seconds']:.1f}s when it was made)" if reused
           else f"{args.steps} steps in {rec['train_seconds']:.1f}s")
    print(f"{a.kind} ({rec['params']} params) {how}: "
          f"held-out accuracy {rec['held_out_accuracy']:.4f} on {args.n_eval} {args.task} prompts -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
