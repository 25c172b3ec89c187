"""Agents that never wait for each other (`trainer.async.enable=true`, level A of docs/ASYNCHRONOUS.md).

    AsyncHacpoTrainer.fit()      resume, validate, run every agent's loop on the chosen clock,
                                 validate and checkpoint at rounds, log a record per step
    AgentSteps                   what one real agent does in each phase of its loop
                                 (recipe_hacpo/asynchronous/loop.py::agent_loop)
    learner_batch()              own rows + the peer entries taken, as the method's exchange builds
                                 them, groups padded to the joint layout, with advantages

Each agent steps at its own pace: it answers a batch of prompts (the window rule of
asynchronous/schedule.py), publishes its scored rows with its own old log-probs, takes at most one
entry per peer from the buffer (source lag ≤ `max_source_lag`), trains and syncs. ω of a peer's
rows comes from the peer's capability at the version that sampled them. With equal step costs on
the virtual clock every agent answers every batch in data order and takes each peer's rows of the
same batch at lag 0: the run equals the lockstep trainer metric for metric.

Logging: the record of step v holds each agent's v-th step (`agent/<k>/...`, as lockstep) and is
written once every agent has made v steps (the round R = min_k v_k reached v); an agent's own
clock is `agent/<k>/async/version`. A fast agent's records thus reach the logger when the slow
agent catches up; those it makes past the slowest (stop=slowest) are written at the end.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from recipe_hacpo import batch_keys as K
from recipe_hacpo.asynchronous.buffer import Entry, Taken
from recipe_hacpo.asynchronous.loop import STOP_RULES, Shared, agent_loop
from recipe_hacpo.asynchronous.virtual_clock import Timeline, VirtualClock
from recipe_hacpo.asynchronous.wall_clock import WallClock
from recipe_hacpo.atomic_io import atomic_write_text
from recipe_hacpo.cluster.reliability import check_learner_batch
from recipe_hacpo.methods import method_for
from recipe_hacpo.methods.context import StepContext, agent_key, prefixed, unprefixed
from recipe_hacpo.training.trainer import HacpoTrainer, attach_old_log_probs, device_pads, pad_phase, summary_lines
from verl import DataProto

PATH = "trainer.async"
CLOCKS = ("wall", "virtual")
# the virtual clock's share of a step per phase (the recorded CPU demo's medians, rounded:
# tests/fixtures/recorded_runs/cpu_demo_metrics.jsonl); the driver's scoring is its own kind
VIRTUAL_PHASE_SHARES = {"gen": 0.45, "reward": 0.05, "old_log_prob": 0.1, "update_actor": 0.35, "update_weights": 0.05}


@dataclass(frozen=True)
class AsyncSettings:
    enable: bool = False
    clock: str = "wall"
    virtual_step_s: dict = field(default_factory=dict)
    max_source_lag: int = 4
    prompt_window: int = 4
    stop: str = "each"

    @classmethod
    def from_config(cls, trainer: DictConfig) -> "AsyncSettings":
        """`trainer.async` typed and checked; a ConfigError naming the key when one is wrong."""
        from recipe_hacpo.config import ConfigError

        raw = trainer.get("async")
        if raw is None:
            return cls()
        raw = OmegaConf.to_container(raw, resolve=True)
        known = {"enable", "clock", "virtual_step_s", "max_source_lag", "prompt_window", "stop"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"{PATH}.{unknown[0]}: unknown key (known: {', '.join(sorted(known))})")
        s = cls(**raw)
        if s.clock not in CLOCKS:
            raise ConfigError(f"{PATH}.clock: {s.clock!r} is not one of {CLOCKS}")
        if s.stop not in STOP_RULES:
            raise ConfigError(f"{PATH}.stop: {s.stop!r} is not one of {STOP_RULES}")
        if int(s.max_source_lag) < 0:
            raise ConfigError(f"{PATH}.max_source_lag: must be >= 0, got {s.max_source_lag}")
        if int(s.prompt_window) < 1:
            raise ConfigError(f"{PATH}.prompt_window: must be >= 1, got {s.prompt_window}")
        for name, step_s in (s.virtual_step_s or {}).items():
            if not isinstance(step_s, (int, float)) or step_s <= 0:
                raise ConfigError(f"{PATH}.virtual_step_s.{name}: must be a positive number of seconds, got {step_s!r}")
        return s

    def virtual_cost(self, agent: str, phase: str) -> float:
        return float(self.virtual_step_s.get(agent, 1.0)) * VIRTUAL_PHASE_SHARES[phase]


def validate_async(cfg: DictConfig, specs, hacpo) -> AsyncSettings:
    """What asynchronous agents cannot help with, or cannot run yet: one line, before Ray starts."""
    from recipe_hacpo.config import ConfigError

    names = [sp.name for sp in specs]
    device_pads(cfg.trainer, names)  # both trainers pad; checked here, before Ray, for both
    s = AsyncSettings.from_config(cfg.trainer)
    if not s.enable:
        return s
    unknown = sorted(set(s.virtual_step_s) - set(names))
    if unknown:
        raise ConfigError(f"{PATH}.virtual_step_s.{unknown[0]}: no such agent (agents: {', '.join(names)})")
    shared = [sp.name for sp in specs if sp.uses_shared_pool]
    if shared and len(shared) == len(specs):
        raise ConfigError(f"{PATH}.enable: every agent is on the shared pool, where they take turns on the same GPUs "
                          "whether they wait for each other or not; asynchronous agents cannot help "
                          "(give the agents pools of their own: agents.<name>.n_gpus_per_node)")
    if shared:
        raise ConfigError(f"{PATH}.enable: agent {shared[0]} is on the shared pool; asynchronous agents run on pools "
                          "of their own only (agents.<name>.n_gpus_per_node > 0 for every agent)")
    if hacpo.replay_peer is not None:
        raise ConfigError(f"{PATH}.enable: algorithm.hacpo.replay_peer (a recorded peer, lockstep by nature) "
                          "does not run asynchronously")
    if method_for(hacpo.mode).selects_complementary(hacpo):
        raise ConfigError(f"{PATH}.enable: algorithm.hacpo.share_selection=complementary does not run asynchronously yet")
    t = cfg.trainer
    # a sample tape (trainer.replay_samples_dir) replays: an agent's step v asks for the seeds of
    # its own step v, so a tape recorded at equal costs serves any run whose agents make those steps
    for key in ("record_rollouts_dir", "rollout_data_dir"):
        if t.get(key):
            raise ConfigError(f"trainer.{key}: not available with {PATH}.enable=true yet")
    return s


# ====================================================================== one agent's phases
class AgentSteps:
    """The phases of one real agent's loop (asynchronous/loop.py's Participant)."""

    def __init__(self, trainer: "AsyncHacpoTrainer", name: str) -> None:
        self.trainer, self.name = trainer, name
        self.agent = trainer.agents[name]
        self.version = 0
        self.metrics: dict[str, float] = {}
        self.timing: dict[str, float] = {}

    def _timed(self, phase: str, fn):
        self.trainer.announce(self.name, self.version + 1, phase)
        start = time.perf_counter()
        out = fn()
        pad_phase(self.trainer.device_pads, self.name, phase, start)
        self.timing[phase] = time.perf_counter() - start
        return out

    def generate(self, batch: int, version: int) -> DataProto:
        self.version, self.metrics, self.timing = version, {}, {}
        prompts = self.trainer.prompts(batch)
        return self._timed("gen", lambda: self.agent.generate(prompts, step=version + 1))

    def score(self, rollouts: DataProto) -> float:
        scored = self._timed("reward", lambda: self.trainer.score_rollouts(self.name, rollouts))
        self.metrics.update(scored)
        return scored["reward/mean"]

    def old_log_probs(self, rollouts: DataProto) -> tuple[DataProto, int]:
        lp = self._timed("old_log_prob", lambda: self.agent.old_log_prob(rollouts))
        attach_old_log_probs(self.name, rollouts, lp)
        checked: dict[str, float] = {}
        self.trainer.check_rollout_policy({self.name: rollouts}, checked, step=self.version + 1)
        self.metrics.update(unprefixed(checked, self.name))
        return rollouts, payload_bytes(rollouts)

    def update(self, rollouts: DataProto, peers: list[Entry], capabilities: dict[str, float]) -> dict[str, float]:
        t = self.trainer
        step = self.version + 1
        batch, metrics = t.learner_batch(self.name, rollouts, peers, capabilities, step)
        if self.agent.use_ref:
            batch.batch["ref_log_prob"] = self._timed("ref", lambda: self.agent.ref_log_prob(batch))
        check_learner_batch(self.name, batch, step)
        t.dump_learner_batch(self.name, step, batch)
        method = t.method
        rows = method.rows_per_prompt(t.specs, self.agent.spec, t.hacpo)
        order = partial(method.mini_batch_order, t.hacpo)
        out = self._timed("update_actor", lambda: self.agent.update(batch, rows, order=order))
        metrics.update(t.update_metrics(self.name, out))
        metrics.update(self.metrics)
        metrics["capability"] = float(capabilities[self.name])
        metrics.update(lag_metrics(t.shared.buffer.taken_at(self.name, self.version)))
        return metrics

    def sync(self) -> None:
        step = self.version + 1
        self._timed("update_weights", lambda: self.agent.sync_weights(step))
        extra = {}
        every = int(self.trainer.config.trainer.test_freq)
        if every > 0 and step % every == 0:
            # each agent validates at its own steps, on its own pool (not a cost of the virtual clock)
            extra = self._timed("validate", lambda: self.trainer.validate_one(self.name))
        extra.update({f"timing_s/{k}": v for k, v in self.timing.items()})
        self.trainer.stop_clock.note_step(sum(v for k, v in self.timing.items() if k != "validate"))
        self.trainer.step_finished(self.name, step, extra)


def payload_bytes(batch: DataProto) -> int:
    return int(sum(v.numel() * v.element_size() for v in batch.batch.values()))


def lag_metrics(taken: list[Taken]) -> dict[str, float]:
    """async/{peers_taken, cross_lag_mean, cross_lag_max, joint_frac} of one take (its manifest lines)."""
    lags = [m.lag for m in taken]
    return {
        "async/peers_taken": float(len(taken)),
        "async/cross_lag_mean": float(np.mean(lags)) if lags else 0.0,
        "async/cross_lag_max": float(max(lags)) if lags else 0.0,
        "async/joint_frac": float(np.mean([m.joint for m in taken])) if taken else 0.0,
    }


# ====================================================================== the padded joint layout
def pad_groups(batch: DataProto, specs, learner, joint_layout: bool) -> DataProto:
    """Every prompt group of `batch` in the joint layout: each agent's part present, those missing
    (a peer that has not answered the learner's batch; the learner's own part in a group of a
    peer's older batch) filled with copies of one of the group's rows that carry no response
    token and `SELECTED` false, so they are in neither the loss, its row count nor the group's
    advantage statistics. Returns `batch` itself when no group misses a part (or the method's
    groups are not joint: `joint_layout` false)."""
    if not joint_layout:
        return batch
    uid = batch.non_tensor_batch["uid"].astype(str)
    source = batch.batch[K.SOURCE].numpy()
    fillers = []
    for group in dict.fromkeys(uid.tolist()):
        rows = np.flatnonzero(uid == group)
        present = set(source[rows].tolist())
        for s in specs:
            if s.index in present:
                continue
            filler = batch.select_idxs(torch.as_tensor([int(rows[0])] * s.rollout_n))
            filler.batch["response_mask"] = torch.zeros_like(filler.batch["response_mask"])
            filler.batch[K.SOURCE] = torch.full((s.rollout_n,), s.index, dtype=torch.long)
            filler.batch[K.IS_CROSS] = torch.full((s.rollout_n,), s.index != learner.index, dtype=torch.bool)
            filler.batch[K.OMEGA] = torch.ones(s.rollout_n)
            filler.batch["old_log_probs"] = torch.zeros_like(filler.batch["old_log_probs"])
            filler.batch[K.REWARD] = torch.zeros_like(filler.batch[K.REWARD])
            filler.batch[K.SELECTED] = torch.zeros(s.rollout_n, dtype=torch.bool)
            fillers.append(filler)
    if not fillers:
        return batch
    batch.batch[K.SELECTED] = torch.ones(len(batch), dtype=torch.bool)
    return DataProto.concat([batch, *fillers])


# ====================================================================== the trainer
class AsyncHacpoTrainer(HacpoTrainer):
    """The lockstep trainer's agents, verifier, method and checkpoints, run without barriers."""

    asynchronous = True

    def __init__(self, config: DictConfig, specs, hacpo, settings: AsyncSettings) -> None:
        super().__init__(config, specs, hacpo)
        self.settings = settings
        self.driver_lock = threading.Lock()  # the prompts and the records, across agent threads
        self.shared: Shared | None = None
        self._prompts: dict[int, dict] = {}
        self._draws = None
        self._pending: dict[int, dict[str, dict]] = {}  # step v -> {agent: its v-th step's metrics}
        self._logged = 0  # steps whose record is written
        self._logger = None
        self._summary_every = 0  # fit's summary_every: one short line per agent every that many steps
        self._virtual_start = 0.0
        self._saved_round: int | None = None  # newest round with a joint checkpoint of this run
        self._validated: dict[str, int] = {}  # agent -> the newest of its versions validated
        self._val_list: list | None = None
        self.joint_only = self.method.joint_only

    def init_workers(self, train_dataloader, val_dataloader, total_steps: int) -> None:
        super().init_workers(train_dataloader, val_dataloader, total_steps)
        # every conversion runs in the learner's own update phase (a peer's rows are converted when taken)
        self.conversion_jobs = None

    # ------------------------------------------------------------------ prompts
    def prompts(self, batch: int) -> DataProto:
        """Batch `batch` of the shared draw order (the b-th batch of the data, epoch after epoch)."""
        with self.driver_lock:
            while batch not in self._prompts:
                drawn = max(self._prompts, default=-1) + 1
                self._prompts[drawn] = self._next_batch_dict()
            # the schedule hands out batches of the last `prompt_window` draws only; twice that is
            # kept, for an agent between its schedule phase and its generation
            keep_from = self.shared.schedule.drawn - 2 * self.settings.prompt_window
            for old in [b for b in self._prompts if b < keep_from]:
                del self._prompts[old]
            batch_dict = self._prompts[batch]
        prompts = DataProto.from_single_dict(batch_dict)
        # named as the lockstep trainer names step b + 1's prompts, so equal costs give equal batches
        prompts.non_tensor_batch["uid"] = np.array([f"step{batch + 1}-prompt{i}" for i in range(len(prompts))], dtype=object)
        return prompts

    def _next_batch_dict(self) -> dict:
        if self._draws is None:
            self._draws = iter(self.train_dataloader)
        try:
            return next(self._draws)
        except StopIteration:
            self._draws = iter(self.train_dataloader)
            return next(self._draws)

    # ------------------------------------------------------------------ a learner's batch
    def learner_batch(self, name: str, rollouts: DataProto, peers: list[Entry], capabilities: dict[str, float],
                      step: int) -> tuple[DataProto, dict[str, float]]:
        """`name`'s learner batch from its rollouts and the peer entries it took, with advantages."""
        caps = torch.tensor([capabilities.get(s.name, self.shared.capabilities.capability(s.name)) for s in self.specs],
                            dtype=torch.float32)
        sources = {name: rollouts, **{e.source: e.payload for e in peers}}
        # a method whose takes are joint only (GRAFT, SGT: they compare the agents' answers to the
        # same prompts) sees the learner and the peers that answered its batch
        specs = tuple(s for s in self.specs if s.name in sources) if self.joint_only else tuple(self.specs)
        ctx = StepContext(
            specs=specs, settings=self.hacpo, effective=self.effective, step=step, capabilities=caps,
            seed_of=lambda n: int(self.agents[n].config.actor_rollout_ref.actor.data_loader_seed),
            convert=self.convert_rows, old_log_probs_of_rows=self._learner_log_probs_of_rows, learners=(name,),
        )
        method = self.method
        batches, metrics = method.exchange(ctx, sources)
        learner = next(s for s in self.specs if s.name == name)
        # HACPO's joint groups hold every agent's part (Hacpo.rows_per_prompt); GRAFT's and SGT's
        # groups are the learner's own size whatever it took
        batch = pad_groups(batches[name], self.specs, learner, method.joint_groups)
        mine = dict(metrics[name])
        mine.update(method.advantages(ctx, {name: batch})[name])
        mine["async/filler_rows"] = float(len(batch) - len(batches[name]))
        return batch, mine

    def _learner_log_probs_of_rows(self, requests: dict, phase: str) -> dict:
        """A learner's old log-probs of some rows of its batch (GRAFT's grafted rows), on its own
        workers, inside its own update phase (no other agent is asked)."""
        return {n: self.agents[n].old_log_prob_of_rows(*req) for n, req in requests.items()}

    def val_batches(self):
        """The validation batches, read once: agents validating at once each walk the same list."""
        with self.driver_lock:
            if self._val_list is None:
                self._val_list = list(self.val_dataloader)
        return self._val_list

    def validate_one(self, name: str) -> dict[str, float]:
        """`name`'s held-out metrics, named below agent/<name>/ (as its step's own metrics are)."""
        out = self.validate(only=name)
        self._validated[name] = self.shared.buffer.versions[name]
        return unprefixed(out, name)

    def announce(self, name: str, step: int, phase: str) -> None:
        """With `trainer.progress_file`: {"agent", "step", "phase", "time", "round"} of the phase an
        agent starts (the newest of any agent's), for watchdogs and for the tests that kill a run
        at a chosen phase."""
        path = self.config.trainer.get("progress_file")
        if path:
            record = {"agent": name, "step": step, "phase": phase, "time": time.time(), "round": self.shared.round}
            with self.driver_lock:
                atomic_write_text(str(path), json.dumps(record))

    # ------------------------------------------------------------------ records
    def step_finished(self, name: str, step: int, timing: dict[str, float]) -> None:
        """After `name`'s step `step` synced: its metrics wait for the other agents' step `step`."""
        shared = self.shared
        with self.driver_lock:
            # taken out of the shared state, which checkpoints hold: the pending records keep it
            at = next(i for i in range(len(shared.metrics) - 1, -1, -1) if shared.metrics[i][:2] == (name, step))
            metrics = shared.metrics.pop(at)[2]
            record = {**metrics, **timing, "async/version": float(step), "async/round": float(shared.round)}
            self._pending.setdefault(step, {})[name] = record
            self._write_ready(final=False)

    def _write_ready(self, final: bool) -> None:
        """Write the records of every step each agent has made (every pending step at the end)."""
        names = [s.name for s in self.specs]
        while self._pending:
            v = min(self._pending)
            if not final and set(self._pending[v]) != set(names):
                return
            data = prefixed(self._pending.pop(v))
            buf = self.shared.buffer
            data.update({"async/buffer/entries": float(len(buf.entries)), "async/buffer/bytes": float(buf.nbytes),
                         "async/buffer/evicted_stale": float(buf.evicted_stale), "training/global_step": v})
            self._logger.log(data=data, step=v)
            self._logged = v
            if self._summary_every > 0 and (v % self._summary_every == 0 or v == self.total_steps):
                print(summary_lines(data, v, self.total_steps), flush=True)

    # ------------------------------------------------------------------ checkpoints
    def _meet(self, requested: int, at: float) -> float:
        """Every agent parked at its step boundary: the joint checkpoint (save_freq, asked for at
        round `requested`), or a stop to be resumed (a signal, a deadline: preemption.py), which
        publishes one and raises ResumableStop. Named by the round the agents met at (those that
        were mid-step when it was asked for finished that step first)."""
        t = self.config.trainer
        round_ = self.shared.round
        reason = self.stop_reason()
        if reason is not None:
            print(f"hacpo: every agent stopped at its step boundary (round {round_}): {reason}", flush=True)
            self._stop_for_resume(reason, self._saved_round, self.async_state(round_, at))
        if t.save_freq > 0 and requested % t.save_freq == 0:
            saving = time.perf_counter()
            self.save_async_checkpoint(round_, at)
            self.stop_clock.note_checkpoint(time.perf_counter() - saving)
        self.shared.checkpoint_done(round_)
        return 0.0

    def stop_reason(self) -> str | None:
        """Why the agents should stop at their next step boundaries (a signal, a near deadline), or None."""
        return self.stop_clock.stop_before_step(self.stop_signals.first)

    def save_async_checkpoint(self, round_: int, at: float) -> str:
        path = self.save_checkpoint(self.async_state(round_, at))
        self._saved_round = round_
        print(f"hacpo: joint checkpoint of round {round_} (versions {dict(self.shared.buffer.versions)}) at {path}",
              flush=True)
        return path

    def async_state(self, round_: int, at: float) -> dict:
        """One joint checkpoint's state: each agent at its own version, the schedule, the buffer
        (its rows included), the prompts of the window, the data position, the records not yet
        written, the virtual clock."""
        versions = dict(self.shared.buffer.versions)
        return {
            "global_step": round_, "agents": [s.name for s in self.specs], "agent_steps": versions,
            "async": {"shared": self.shared.state_dict(), "prompts": dict(self._prompts),
                      "pending": {v: dict(m) for v, m in self._pending.items()}, "logged": self._logged,
                      "virtual_time": float(at) if self.settings.clock == "virtual" else 0.0},
            "dataloader": self.train_dataloader.state_dict(),
            "torch_rng": torch.get_rng_state(), "numpy_rng": np.random.get_state(),
        }

    def _restore(self) -> bool:
        if not self.load_checkpoint():
            return False
        a = self.loaded_state["async"]
        self.shared = Shared.from_state(a["shared"])
        # this launch's settings, as the lockstep trainer's total_training_steps may grow on resume
        s = self.settings
        self.shared.total_steps, self.shared.stop = self.total_steps, s.stop
        self.shared.buffer.max_source_lag, self.shared.schedule.window = int(s.max_source_lag), int(s.prompt_window)
        self._prompts = {int(b): d for b, d in a["prompts"].items()}
        self._pending = {int(v): dict(m) for v, m in a["pending"].items()}
        self._logged = int(a["logged"])
        self._virtual_start = float(a["virtual_time"])
        return True

    # ------------------------------------------------------------------ the run
    def fit(self, logger, progress: bool = True, summary_every: int = 0) -> dict[str, float]:
        from recipe_hacpo.cluster.preemption import StopClock

        s, t = self.settings, self.config.trainer
        self._logger, self._summary_every = logger, summary_every
        self.stop_clock = StopClock(self.preemption, end_time=self._deadline_in_advance())
        resumed = self._restore()
        self.resumed_from = self.global_step
        names = tuple(sp.name for sp in self.specs)
        if not resumed:
            self.shared = Shared.start(names, self.total_steps, window=s.prompt_window, max_source_lag=s.max_source_lag,
                                       capability_window=self.hacpo.window, capability_floor=self.hacpo.capability_floor,
                                       stop=s.stop, save_every=int(t.save_freq) if t.save_freq > 0 else 0)
        self.shared.stop_wanted = lambda: self.stop_reason() is not None
        if t.get("val_before_train", True) and not resumed:
            print("hacpo: validating the agents before training", flush=True)
            logger.log(data=self.validate(), step=0)
        peers = names if self.method.shares else ()
        loops = {n: agent_loop(AgentSteps(self, n), self.shared, peers=peers, joint_only=self.joint_only) for n in names}
        pools = {n: n for n in names}
        print(f"hacpo: asynchronous agents on the {s.clock} clock (max_source_lag={s.max_source_lag}, "
              f"prompt_window={s.prompt_window}, stop={s.stop})", flush=True)
        if s.clock == "virtual":
            clock = VirtualClock(s.virtual_cost, pools, on_checkpoint=self._meet, start=self._virtual_start)
        else:
            clock = WallClock(pools, on_checkpoint=self._meet)
        try:
            timeline = clock.run(loops)
            self.global_step = self.shared.round
            last = self._finish(timeline)
        finally:
            self.verifier.close()
        return last

    def _finish(self, timeline: Timeline) -> dict[str, float]:
        """The last round: validation, the last checkpoint, every pending record, the run's summary."""
        t, round_ = self.config.trainer, self.shared.round
        summary = {"async/end_s": timeline.end}
        for name in timeline.agent_busy:
            summary[agent_key(name, "async/pool_busy_frac")] = timeline.busy_fraction(name)
            summary[agent_key(name, "async/wait_s")] = timeline.pool_wait[name] + timeline.checkpoint_wait[name]
            summary[agent_key(name, "async/steps")] = float(self.shared.buffer.versions[name])
        if t.test_freq > 0:  # every agent validated at its last step
            for name, version in self.shared.buffer.versions.items():
                if self._validated.get(name) != version and version > 0:
                    val = prefixed({name: self.validate_one(name)})
                    summary.update(val)
        if t.save_freq > 0 and self._saved_round != round_:
            self.save_async_checkpoint(round_, timeline.end)
        with self.driver_lock:
            # the steps the faster agents made past the slowest (stop=slowest) too; the checkpoint
            # keeps them pending: a launch that resumes it to more steps writes them again, whole,
            # and the metrics file drops what this launch wrote from that step on (run_metrics.py)
            self._write_ready(final=True)
            self._logger.log(data=summary, step=max(round_, self._logged))
        print("hacpo: asynchronous run done: " + ", ".join(
            f"{n} {int(self.shared.buffer.versions[n])} steps, pool {100 * timeline.busy_fraction(n):.0f} % busy"
            for n in timeline.agent_busy) + f", {timeline.end:.1f} {'virtual ' if self.settings.clock == 'virtual' else ''}s",
            flush=True)
        return summary
