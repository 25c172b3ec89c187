"""Where a run's per-step metrics go: always into the run's own folder, whatever the console shows.

Every run writes, under `trainer.metrics_dir` (default: `trainer.default_local_dir`, beside the
checkpoints):
    metrics.jsonl   one line per logged step, `{"step": k, "data": {...}}` (verl's file logger's
                    format), every metric docs/METRICS.md names
    tensorboard/    TensorBoard event files (verl's `tensorboard` backend)
`trainer.logger` adds backends (console, wandb, mlflow, ...); it cannot take these two away.
A quiet run (`trainer.summary_every` > 0) replaces only the console's full line per step.

The JSONL file is appended to, not rewritten: a resumed or requeued run keeps the lines of the
steps it resumed after and drops only the lines of steps it is about to log again (those of the
attempt that was stopped after its last checkpoint), so the file holds each step once.
`VERL_FILE_LOGGER_PATH`, when set, names the file instead (as for verl's file logger), and
`TENSORBOARD_DIR` the event folder. With `trainer.log_val_generations` = n, n samples of each
agent's validation go to `val_generations.jsonl` beside the metrics (and to wandb / TensorBoard).

With `wandb` in `trainer.logger`, the run's wandb id is kept in `metrics_dir/wandb_run_id`: a
resumed or requeued run continues the same wandb run (`WANDB_RUN_ID`, `WANDB_RESUME=allow`,
unless set). On compute nodes without network, `WANDB_MODE=offline` keeps it local for a later
`wandb sync`.
"""

from __future__ import annotations

import json
import os

from omegaconf import DictConfig

from recipe_hacpo.hacpo_settings import ConfigError
from recipe_hacpo.methods.context import agent_key

JSONL_NAME, TENSORBOARD_NAME, WANDB_ID_FILE = "metrics.jsonl", "tensorboard", "wandb_run_id"
GENERATIONS_NAME = "val_generations.jsonl"  # trainer.log_val_generations
# always on; "file" is this module's writer, not verl's (which truncates its file at every start)
ALWAYS = ("file", "tensorboard")


def metrics_dir(cfg: DictConfig) -> str:
    return os.path.abspath(str(cfg.trainer.get("metrics_dir") or cfg.trainer.default_local_dir))


def jsonl_path(cfg: DictConfig) -> str:
    return os.environ.get("VERL_FILE_LOGGER_PATH") or os.path.join(metrics_dir(cfg), JSONL_NAME)


def backends(cfg: DictConfig, verbose: bool) -> list[str]:
    """The backends of a run: `trainer.logger` plus the two that are always on; a quiet run
    drops the console's full metrics line (the trainer prints its short per-agent lines)."""
    configured = cfg.trainer.logger
    configured = [configured] if isinstance(configured, str) else list(configured or [])
    chosen = list(dict.fromkeys([*configured, *ALWAYS]))
    if not verbose and int(cfg.trainer.get("summary_every", 0) or 0) > 0:
        chosen = [b for b in chosen if b != "console"]
    return chosen


def wandb_run_id(folder: str) -> str:
    """The wandb run id of the run whose metrics go to `folder`: made once, then read back."""
    path = os.path.join(folder, WANDB_ID_FILE)
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        pass
    import uuid

    from recipe_hacpo.atomic_io import atomic_write_text

    os.makedirs(folder, exist_ok=True)
    run_id = uuid.uuid4().hex[:16]
    atomic_write_text(path, run_id)
    return run_id


class JsonlMetrics:
    """Appends `{"step", "data"}` lines; the first line logged drops every kept line of that
    step or later (what a stopped attempt logged past the checkpoint this run resumed from)."""

    def __init__(self, path: str):
        self.path = path
        self._trimmed = False
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def log(self, data: dict, step: int) -> None:
        if not self._trimmed:
            self._trim(step)
            self._trimmed = True
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": int(step), "data": data}, default=float) + "\n")

    def _trim(self, first_step: int) -> None:
        if not os.path.exists(self.path):
            return
        kept = []
        with open(self.path) as f:
            for line in f:
                try:
                    if int(json.loads(line)["step"]) < first_step:
                        kept.append(line if line.endswith("\n") else line + "\n")
                except (ValueError, KeyError, TypeError):
                    continue  # a line torn by a kill mid-write
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)


class RunMetrics:
    """What the trainer logs to: verl's `Tracking` for every backend but "file", and this
    module's JSONL writer. Built before Ray starts, so a backend that cannot start (a wandb
    key, no network) fails within seconds; `finish()` closes every backend once."""

    def __init__(self, cfg: DictConfig, verbose: bool):
        from verl.utils.tracking import Tracking

        from omegaconf import OmegaConf

        chosen = self.chosen = backends(cfg, verbose)
        self.generations: JsonlMetrics | None = None  # val_generations.jsonl, opened by the first log
        self._tables: dict[str, list] = {}  # wandb: every row logged so far, per agent
        self._writer = None  # TensorBoard's writer of the generations' text
        unknown = [b for b in chosen if b not in Tracking.supported_backend]
        if unknown:
            raise ConfigError(f"trainer.logger: unknown backend {unknown[0]!r}; verl knows {', '.join(Tracking.supported_backend)}")
        os.environ.setdefault("TENSORBOARD_DIR", os.path.join(metrics_dir(cfg), TENSORBOARD_NAME))
        if "wandb" in chosen:
            os.environ.setdefault("WANDB_RUN_ID", wandb_run_id(metrics_dir(cfg)))
            os.environ.setdefault("WANDB_RESUME", "allow")
        self.jsonl = JsonlMetrics(jsonl_path(cfg))
        try:
            self.tracking = Tracking(
                project_name=cfg.trainer.project_name,
                experiment_name=cfg.trainer.experiment_name,
                default_backend=[b for b in chosen if b != "file"],
                config=OmegaConf.to_container(cfg, resolve=True),
            )
        except Exception as exc:
            if "wandb" not in chosen:
                raise
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ConfigError(
                f"trainer.logger has wandb, which did not start ({type(exc).__name__}: {first}); on a node without "
                "network set WANDB_MODE=offline (and `wandb sync` later), or log in with WANDB_API_KEY"
            ) from exc

    def log(self, data: dict, step: int) -> None:
        self.jsonl.log(data, step)
        self.tracking.log(data=data, step=step)

    def log_generations(self, samples: dict[str, list[tuple[str, str, float]]], n: int, step: int) -> None:
        """`trainer.log_val_generations` = n: n validation samples of each agent, (input, output,
        score), chosen by verl's rule (`chosen_samples`). Always into `val_generations.jsonl`
        beside metrics.jsonl (one line per validation: {"step", "data": {agent: [samples]}},
        resumed as metrics.jsonl is); with wandb a table `agent/<name>/val/generations` that grows
        by n rows per validation; a TensorBoard text of the same name."""
        chosen = {name: chosen_samples(rows, n) for name, rows in samples.items()}
        if self.generations is None:
            self.generations = JsonlMetrics(os.path.join(os.path.dirname(self.jsonl.path), GENERATIONS_NAME))
        self.generations.log({name: [{"input": i, "output": o, "score": float(r)} for i, o, r in rows]
                              for name, rows in chosen.items()}, step)
        if "wandb" in self.chosen:
            import wandb

            for name, rows in chosen.items():
                table = self._tables.setdefault(name, [])
                table += [[step, i, o, float(r)] for i, o, r in rows]
                if wandb.run is not None:
                    wandb.log({agent_key(name, "val/generations"): wandb.Table(
                        columns=["step", "input", "output", "score"], data=list(table))}, step=step)
        writer = self._text_writer()
        for name, rows in chosen.items():
            text = "\n\n".join(f"**input** {i}\n\n**output** {o}\n\n**score** {float(r)}" for i, o, r in rows)
            writer.add_text(agent_key(name, "val/generations"), text, global_step=step)
        writer.flush()

    def _text_writer(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=os.environ["TENSORBOARD_DIR"])
        return self._writer

    def finish(self, exit_code: int = 0) -> None:
        if self._writer is not None:
            self._writer.close()
        self.tracking.finish(exit_code=exit_code)


def chosen_samples(rows: list[tuple], n: int) -> list[tuple]:
    """The n samples verl's trainer logs of a validation (`log_val_generations`): sorted by input,
    shuffled with seed 42, the first n; the same prompts at every validation."""
    import numpy as np

    ordered = sorted(rows, key=lambda r: r[0])
    np.random.RandomState(42).shuffle(ordered)
    return ordered[:n]
