"""A trained run's agents as Hugging Face folders, one per agent: what inference, vLLM and the Hub take.

    python -m recipe_hacpo.export outputs/<pair>_<method>/checkpoints --out exported/ [--step N] [--agents a,b] [--dtype bfloat16]

The first argument is a run's checkpoint folder (`trainer.default_local_dir`: its newest complete
checkpoint, or `--step N`) or one `global_step_N` folder. Each agent's FSDP shards are merged
into `<out>/<agent>/` with safetensors weights, config, tokenizer, chat template and generation
config; a LoRA agent's adapter is folded into its weights. `--dtype` casts the weights (default:
the dtype the model was trained from, as its config says). The same merge serves
`python -m recipe_hacpo.evaluate --agents-from` (recipe_hacpo/evaluation/checkpoints.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence

from recipe_hacpo import quiet  # noqa: F401  (no progress bars unless HACPO_VERBOSE=1)
from recipe_hacpo.evaluation import EvalError
from recipe_hacpo.evaluation.checkpoints import checkpoint_agents, merge_fsdp_checkpoint, path_name
from recipe_hacpo.cluster.reliability import CheckpointError, checkpoint_problem, find_resume_checkpoint
from recipe_hacpo.training.run_identity import describe_checkpoint

DTYPES = ("bfloat16", "float16", "float32")


def step_folder(run: str, step: int | None) -> str:
    """The `global_step_N` folder to export: `run` itself, `run/global_step_<step>`, or the newest
    complete checkpoint under `run`."""
    if os.path.basename(os.path.normpath(run)).startswith("global_step_"):
        if step is not None:
            raise EvalError(f"{run}: already one checkpoint; --step {step} names another")
        folder = run
    elif step is not None:
        folder = os.path.join(run, f"global_step_{step}")
    else:
        try:
            folder = find_resume_checkpoint(run).path
        except CheckpointError as exc:
            raise EvalError(str(exc)) from None
        if folder is None:
            raise EvalError(f"{run}: no complete checkpoint (global_step_N with hacpo_state.pt) to export")
    problem = checkpoint_problem(folder)
    if problem is not None:
        raise EvalError(f"{folder}: {problem}; not a complete checkpoint")
    return folder


def export(run: str, out: str, *, step: int | None = None, agents: Sequence[str] | None = None,
           dtype: str | None = None, log: Callable[[str], None] = print) -> dict[str, str]:
    """{agent: exported folder}; every check (the checkpoint, the agents, the dtype) comes before
    the first merge. `log` first gets one line naming what trained the checkpoint (method, agents, step)."""
    if dtype is not None and dtype not in DTYPES:
        raise EvalError(f"--dtype {dtype}: one of {', '.join(DTYPES)}")
    folder = step_folder(run, step)
    log(describe_checkpoint(folder))
    found = checkpoint_agents(folder)
    chosen = list(agents) if agents else found
    missing = [a for a in chosen if a not in found]
    if missing:
        raise EvalError(f"{folder}: no agent {missing[0]!r} (it holds {', '.join(found) or 'none'})")
    done = {}
    for agent in chosen:
        target = os.path.join(out, path_name(agent))
        merge_fsdp_checkpoint(os.path.join(folder, agent, "actor"), target, dtype)
        done[agent] = target
    return done


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Export a run's agents as Hugging Face folders.")
    p.add_argument("run", help="a run's checkpoint folder (trainer.default_local_dir) or one global_step_N folder")
    p.add_argument("--out", required=True, help="one folder per agent is written here")
    p.add_argument("--step", type=int, default=None, help="export global_step_N (default: the newest complete one)")
    p.add_argument("--agents", default="", help="comma-separated agent names (default: every agent)")
    p.add_argument("--dtype", default=None, choices=DTYPES, help="cast the weights (default: the model config's dtype)")
    a = p.parse_args(argv)
    try:
        done = export(a.run, a.out, step=a.step, agents=[x for x in a.agents.split(",") if x], dtype=a.dtype,
                      log=lambda line: print(line, flush=True))
    except EvalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for agent, target in done.items():
        print(f"{agent}: {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
