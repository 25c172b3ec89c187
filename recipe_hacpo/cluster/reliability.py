"""Failure handling the trainer relies on, kept free of Ray so each piece is testable alone.

    find_resume_checkpoint   the newest *complete* checkpoint under a root (torn ones skipped)
    checkpoint_to_resume     the checkpoint trainer.resume_mode asks for (or none)
    prune_checkpoints        keep the newest K complete checkpoints (trainer.max_actor_ckpt_to_keep)
    saved_world_size         how many ranks wrote an agent's actor state in a checkpoint
    checkpoint_problem       why a checkpoint directory cannot be loaded, or None
    check_learner_batch      non-finite values in a learner batch, reported per agent
    check_update_metrics     non-finite loss (stop) / grad norm (update skipped by verl, counted)
    describe_failure         one line for an exception raised by an agent's Ray workers
    call_with_deadlines      run calls on daemon threads, each with its own time limit
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

STATE_FILE = "hacpo_state.pt"
LATEST_FILE = "latest_checkpointed_iteration.txt"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
# a checkpoint on its way out: renamed first (one atomic step, after which no resume can choose
# it), then deleted; a kill in between leaves only this name behind, swept by the next prune
_PRUNING = re.compile(r"^\.global_step_\d+\.pruning$")


class CheckpointError(RuntimeError):
    """A checkpoint that was asked for cannot be loaded; the message is one line."""


class AgentError(RuntimeError):
    """A step phase failed in one agent's workers; `agent` names it."""

    def __init__(self, agent: str, message: str) -> None:
        super().__init__(f"agent {agent!r}: {message}")
        self.agent = agent


class RolloutMismatchError(AgentError):
    """An agent's rollout engine does not sample from the policy being trained
    (`trainer.rollout_check`, recipe_hacpo/rollout_check.py); raised before the update."""


# ------------------------------------------------------------------------------ checkpoints


def checkpoint_problem(path: str, agent_names: Sequence[str] | None = None) -> str | None:
    """Why `path` is not a complete HACPO checkpoint, or None when it is.

    Complete means: the trainer state file is there and non-empty, and every agent has a
    non-empty `actor/` directory (what its workers wrote).
    """
    if not os.path.isdir(path):
        return "no such directory"
    state = os.path.join(path, STATE_FILE)
    if not os.path.isfile(state) or os.path.getsize(state) == 0:
        return f"{STATE_FILE} missing"
    for name in agent_names or ():
        actor = os.path.join(path, name, "actor")
        if not os.path.isdir(actor) or not os.listdir(actor):
            return f"agent {name!r} has no saved actor state"
    return None


def checkpoint_steps(root: str) -> list[int]:
    """Steps of the `global_step_N` directories under `root`, ascending (`.tmp` ones excluded)."""
    if not os.path.isdir(root):
        return []
    steps = []
    for entry in os.listdir(root):
        m = _STEP_DIR.match(entry)
        if m and os.path.isdir(os.path.join(root, entry)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def read_latest_pointer(root: str) -> int | None:
    """The step named by `latest_checkpointed_iteration.txt`, None if absent or unreadable."""
    try:
        with open(os.path.join(root, LATEST_FILE)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


@dataclass
class ResumeChoice:
    path: str | None  # the checkpoint to load, None for a fresh start
    skipped: list[str]  # "global_step_N: why" for every newer torn checkpoint passed over


def find_resume_checkpoint(root: str, agent_names: Sequence[str] | None = None) -> ResumeChoice:
    """The newest complete checkpoint under `root`.

    Torn checkpoints (a `global_step_N.tmp` left by a kill during the write, a directory
    without the state file or an agent's weights) are never chosen. The latest pointer is a
    hint only: a complete checkpoint newer than it (a kill between publishing the directory
    and updating the pointer) is used. A pointer that names a step while no complete
    checkpoint exists at all is an error, not a silent fresh start.
    """
    skipped = []
    for step in reversed(checkpoint_steps(root)):
        path = os.path.join(root, f"global_step_{step}")
        problem = checkpoint_problem(path, agent_names)
        if problem is None:
            return ResumeChoice(path, skipped)
        skipped.append(f"global_step_{step}: {problem}")
    pointer = read_latest_pointer(root)
    if pointer is not None:
        raise CheckpointError(
            f"{os.path.join(root, LATEST_FILE)} names step {pointer} but {root} holds no complete checkpoint"
            + (f" ({'; '.join(skipped)})" if skipped else "")
            + "; restore it, or set trainer.resume_mode=disable to start over"
        )
    return ResumeChoice(None, skipped)


def checkpoint_to_resume(trainer_cfg: Any, agent_names: Sequence[str]) -> ResumeChoice:
    """The checkpoint `trainer.resume_mode` asks for (`path` None: a fresh start): none with
    `disable`, `trainer.resume_from_path` with `resume_path` (CheckpointError when incomplete),
    else the newest complete one under `trainer.default_local_dir`."""
    mode = str(trainer_cfg.resume_mode)
    if mode == "disable":
        return ResumeChoice(None, [])
    if mode == "resume_path":
        path = str(trainer_cfg.resume_from_path)
        problem = checkpoint_problem(path, agent_names)
        if problem is not None:
            raise CheckpointError(f"trainer.resume_from_path={path!r}: {problem}; not a complete HACPO checkpoint")
        return ResumeChoice(path, [])
    # the newest complete checkpoint: torn ones (killed mid-write) are never loaded
    return find_resume_checkpoint(str(trainer_cfg.default_local_dir), agent_names)


def saved_world_size(actor_dir: str) -> int | None:
    """The data-parallel world that wrote `actor_dir` (verl's FSDP checkpoint: its
    fsdp_config.json, else the `model_world_size_W_rank_R.pt` shard names); None if unknown."""
    try:
        with open(os.path.join(actor_dir, "fsdp_config.json")) as f:
            return int(json.load(f)["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    from recipe_hacpo.workers.verl_touchpoints import FSDP_SHARD_RE

    entries = os.listdir(actor_dir) if os.path.isdir(actor_dir) else ()
    sizes = {int(m.group(1)) for e in entries if (m := FSDP_SHARD_RE.match(e))}
    return sizes.pop() if len(sizes) == 1 else None


def prune_checkpoints(root: str, keep: int | None, agent_names: Sequence[str] | None = None) -> list[str]:
    """Remove every checkpoint under `root` older than its newest `keep` complete ones (None: keep
    all); returns the names removed, oldest first.

    Called after a checkpoint is published, so the one a run resumed from goes only once `keep`
    newer complete ones exist. A torn checkpoint older than the newest `keep` complete ones is
    removed too (nothing can resume from it); a newer torn one is left to the next write of its
    step. Each goes by a rename to `.global_step_N.pruning` before its files are deleted: a kill
    during the deletion leaves nothing that looks like a checkpoint.
    """
    for entry in os.listdir(root) if os.path.isdir(root) else ():
        if _PRUNING.match(entry):
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
    if keep is None:
        return []
    steps = checkpoint_steps(root)
    complete = [s for s in steps if checkpoint_problem(os.path.join(root, f"global_step_{s}"), agent_names) is None]
    if len(complete) <= keep:
        return []
    oldest_kept = complete[-keep]
    removed = []
    for step in steps:
        if step >= oldest_kept:
            break
        name = f"global_step_{step}"
        doomed = os.path.join(root, f".{name}.pruning")
        os.rename(os.path.join(root, name), doomed)
        shutil.rmtree(doomed)
        removed.append(name)
    return removed


# ------------------------------------------------------------------------------ non-finite values


def count_nonfinite_rows(values: torch.Tensor, mask: torch.Tensor | None = None) -> int:
    """Rows of `values` ([B] or [B, T]) holding a NaN/inf where `mask` (same shape) is set."""
    bad = ~torch.isfinite(values.float())
    if mask is not None:
        bad = bad & mask.bool()
    if bad.dim() > 1:
        bad = bad.flatten(1).any(dim=1)
    return int(bad.sum())


# (key, per-token) checked on every learner batch before its update
_LEARNER_FIELDS = (
    ("hacpo_reward", False),
    ("advantages", True),
    ("old_log_probs", True),
    ("hacpo_source_log_prob_mean", False),
    ("hacpo_omega", False),
    ("ref_log_prob", True),
)


def check_learner_batch(agent: str, batch: Any, step: int | None = None) -> None:
    """Raise FloatingPointError naming `agent` when its learner batch holds NaN/inf.

    `batch` is a DataProto (or anything with `.batch[key]`); per-token fields are checked on
    `response_mask` positions only, since padding may legitimately hold -inf log-probs.
    """
    tensors = batch.batch
    keys = set(tensors.keys())
    mask = tensors["response_mask"] if "response_mask" in keys else None
    problems = []
    for key, per_token in _LEARNER_FIELDS:
        if key not in keys:
            continue
        n = count_nonfinite_rows(tensors[key], mask if per_token else None)
        if n:
            problems.append(f"{key} in {n} of {tensors[key].shape[0]} rows")
    if problems:
        where = f" at step {step}" if step is not None else ""
        raise FloatingPointError(
            f"agent {agent!r}: non-finite {', '.join(problems)}{where}; stopping before the update"
        )


def check_update_metrics(agent: str, metrics: dict[str, float]) -> dict[str, float]:
    """Check one agent's update metrics; returns extra metrics to log.

    A non-finite loss stops the run (FloatingPointError naming the agent). A non-finite
    grad norm means verl's optimizer skipped that update (it zeroes the gradients instead of
    stepping): counted as `actor/nonfinite_grad_skipped` and printed, never silent.
    """
    for key, value in metrics.items():
        if key.endswith("loss") and not _finite(value):
            raise FloatingPointError(f"agent {agent!r}: {key} is {value}; stopping before a NaN update is kept")
    grad = metrics.get("grad_norm", metrics.get("actor/grad_norm"))
    skipped = grad is not None and not _finite(grad)
    if skipped:
        print(f"WARN: agent {agent!r}: grad_norm is {grad}; verl skipped this optimizer update", flush=True)
    return {"actor/nonfinite_grad_skipped": float(skipped)}


def _finite(value: Any) -> bool:
    """A finite number; anything that is not a number (None, a string) is not finite either."""
    try:
        return bool(torch.isfinite(torch.as_tensor(float(value))))
    except (TypeError, ValueError):
        return False


# ------------------------------------------------------------------------------ worker failures


def describe_failure(exc: BaseException) -> str:
    """One line for `exc`: a dead worker says so; a remote exception shows its cause."""
    try:
        from ray import exceptions as rex
    except ImportError:  # pragma: no cover - ray is a dependency
        rex = None
    if rex is not None and isinstance(exc, rex.RayActorError):
        return f"its Ray worker died ({type(exc).__name__}: {_first_line(exc)})"
    if rex is not None and isinstance(exc, rex.RayTaskError) and getattr(exc, "cause", None) is not None:
        exc = exc.cause
    if isinstance(exc, AgentError):
        return str(exc).split(": ", 1)[-1]
    return f"{type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else "(no message)"


# ------------------------------------------------------------------------------ deadlines


@dataclass
class CallResult:
    status: str  # "ok", "error" or "timeout"
    value: Any = None  # the return value, or the exception


def call_with_deadlines(
    calls: Sequence[Callable[[], Any]], timeout_s: float, workers: int = 8
) -> list[CallResult]:
    """Run `calls`, at most `workers` at a time, each limited to `timeout_s` from its own start.

    Each call gets its own daemon thread. A call past its limit is abandoned: its slot goes to
    the next call (a hung call never blocks later ones, in this batch or the next) and, being a
    daemon thread, it cannot keep the process from exiting. Total time is at most about
    ceil(len(calls) / workers) × timeout_s.
    """
    n = len(calls)
    results: list[CallResult | None] = [None] * n
    done = threading.Condition()
    finished: list[int] = []

    def run(i: int) -> None:
        try:
            out = CallResult("ok", calls[i]())
        except BaseException as exc:  # noqa: BLE001 - a reward function may raise anything
            out = CallResult("error", exc)
        with done:
            if results[i] is None:
                results[i] = out
            finished.append(i)
            done.notify()

    started: dict[int, float] = {}  # running call -> start time
    nxt = 0
    with done:
        while nxt < n or started:
            while nxt < n and len(started) < max(1, workers):
                started[nxt] = time.monotonic()
                threading.Thread(target=run, args=(nxt,), daemon=True, name=f"hacpo-call-{nxt}").start()
                nxt += 1
            while finished:
                started.pop(finished.pop(), None)
            now = time.monotonic()
            for i, t0 in list(started.items()):
                if now - t0 >= timeout_s and results[i] is None:
                    results[i] = CallResult("timeout")
                    del started[i]
            if started and (nxt >= n or len(started) >= max(1, workers)):
                wait = min(t0 + timeout_s for t0 in started.values()) - time.monotonic()
                done.wait(timeout=max(0.0, wait))
    return [r if r is not None else CallResult("timeout") for r in results]
