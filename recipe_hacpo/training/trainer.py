"""The multi-agent HACPO trainer: one step of spec §7 per batch of prompts.

    HacpoTrainer.fit()          resume, validate, loop over steps, checkpoint
    HacpoTrainer.train_step()   the phases of one step, each a named method:
        1 generate        every agent answers every prompt (G_j samples each)
        2 score           one verifier rewards every response
        3 old_log_probs   each agent scores its own responses (GSPO term, source term of §4)
          capabilities    P̂ update with this step's mean rewards (§1)
        4 exchange        learner batch = own rows + peers' rows re-tokenized for the learner
                          (the token work started in the background as each agent's rollouts
                          returned, exchange/jobs.py; this phase joins it)
          advantages      capability-aware group advantage per learner (§2)
          update          mini-batch updates with the HACPO loss (§3–§6)
        5 sync_weights    trained weights to each agent's rollout engine

Agents live in a dict keyed by name: three agents run exactly like two. Agents on their own
resource pools run a phase concurrently (one thread per agent, each blocking on its own Ray
workers); agents on the shared pool take turns.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import json
import math
import os
import shutil
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
import functools
from functools import partial
from typing import Callable, TypeVar

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from recipe_hacpo import batch_keys as K
from recipe_hacpo.training.agent_runtime import AgentRuntime
from recipe_hacpo.atomic_io import atomic_write_text, replace_dir
from recipe_hacpo.config import AgentSpec, HacpoSettings, agent_verl_config, rollout_check
from recipe_hacpo.methods.core_algos import CapabilityTracker
from recipe_hacpo.exchange.retokenize import RowConverter, mean_log_prob_per_response
from recipe_hacpo.exchange.jobs import ConversionJobs, exchange_workers
from recipe_hacpo.methods import Method, method_for
from recipe_hacpo.methods.context import RecordedRows, StepContext, agent_key, agent_of, prefixed
from recipe_hacpo.cluster.placement import check_ray_cluster, make_pool, master_port_ranges, request_for
from recipe_hacpo.cluster.reliability import (
    LATEST_FILE,
    STATE_FILE,
    AgentError,
    RolloutMismatchError,
    CheckpointError,
    check_learner_batch,
    check_update_metrics,
    checkpoint_to_resume,
    describe_failure,
    prune_checkpoints,
)
from recipe_hacpo.training.progress import ProgressLines
from recipe_hacpo.rollout_check import PATH as ROLLOUT_CHECK_PATH
from recipe_hacpo.training.run_identity import run_identity, write_identity
from recipe_hacpo.rollout_check import agent_precision, mismatch_message, mismatch_stats, violations
from recipe_hacpo.cluster.preemption import (
    PreemptionSettings,
    ResumableStop,
    StepAbandoned,
    StopClock,
    StopSignals,
    slurm_end_time,
)
from recipe_hacpo.methods.replay import RecordedPeer, record_rollouts
from recipe_hacpo.training.rollout_log import rollout_rows, write_rollout_log
from recipe_hacpo.training.scoring import Verifier, attach_rewards, decode_responses, load_reward_fn
from verl import DataProto
from verl.utils.profiler.performance import simple_timer

T = TypeVar("T")

class HacpoTrainer:
    # the background conversions (exchange/jobs.py); None: every conversion runs in the exchange
    # phase (trainer.exchange_workers=0, and trainers assembled without init_workers)
    conversion_jobs: ConversionJobs | None = None
    # the recorded agent replayed as a peer (replay.py, the method's `replay_source`); None: live peers
    replay_peer: RecordedPeer | None = None
    # the step in flight, for a stop signal's decision (preemption.py); None between steps and in
    # trainers assembled without __init__ (tests' stand-ins)
    _step_started: float | None = None
    _step_decision: str | None = None
    # plain progress lines where no terminal shows the bar (progress.py); set by fit
    progress_lines: ProgressLines | None = None
    # the last validation's (input, output, score) per agent, kept until logged; with
    # trainer.log_val_generations > 0 only
    val_samples: dict = {}
    # agents that do not wait for each other (async_trainer.py): its checkpoints differ
    asynchronous: bool = False
    # trainer.device_pad_s, benchmarks only ({agent: {phase: seconds}}; `pad_phase`); none in
    # trainers assembled without __init__
    device_pads: dict = {}

    @property
    def method(self) -> Method:
        """The parts of the step in which methods differ (recipe_hacpo/methods/), by `algorithm.hacpo.mode`."""
        return method_for(self.hacpo.mode)

    def __init__(self, config: DictConfig, specs: list[AgentSpec], hacpo: HacpoSettings) -> None:
        self.config = config
        self.specs = specs
        self.hacpo = hacpo
        self.effective = self.method.effective(hacpo)
        self.device_name = str(config.trainer.device)
        ports = master_port_ranges(config.trainer.master_port_range, [s.name for s in specs])
        self.agents: dict[str, AgentRuntime] = {
            s.name: AgentRuntime(
                spec=s, config=agent_verl_config(config, s), device_name=self.device_name, master_port_range=ports[s.name]
            )
            for s in specs
        }
        self.tracker = CapabilityTracker(
            len(specs), window=hacpo.window, floor=hacpo.capability_floor, omega_clip=hacpo.omega_clip
        )
        self.rollout_check = rollout_check(config)
        self.global_step = 0
        self.agent_timing: dict[str, float] = {}
        self._worker_processes: dict[str, list[str]] | None = None
        self.verifier = Verifier(load_reward_fn(config), timeout_s=float(config.trainer.reward_timeout_s))
        self._pool = cf.ThreadPoolExecutor(max_workers=max(1, len(specs)), thread_name_prefix="hacpo-agent")
        # stopping to be resumed (preemption.py): main.py installs the handlers; `started_at`
        # anchors trainer.preemption.time_limit_s
        self.preemption = PreemptionSettings.from_config(config.trainer)
        self.stop_signals = StopSignals()
        self.started_at = time.time()
        self._step_started: float | None = None
        self._step_decision: str | None = None
        self.device_pads = device_pads(config.trainer, [s.name for s in specs])

    # ================================================================== set-up
    def init_workers(self, train_dataloader, val_dataloader, total_steps: int) -> None:
        self.train_dataloader = train_dataloader
        self.val_dataloader = val_dataloader
        self.total_steps = total_steps
        check_ray_cluster(self.config, self.specs)  # one line naming the agent, instead of a hang
        shared = self._shared_pool()
        # verl sizes each agent's LR schedule from this key
        for agent in self.agents.values():
            OmegaConf.update(agent.config, "actor_rollout_ref.actor.optim.total_training_steps", total_steps, force_add=True)
        # agents on their own pools build at once (each mostly waits on its own Ray actors
        # starting); agents on the shared pool build in turn; a failure names its agent
        self.for_each_agent(lambda a: a.build(self.hacpo, shared if a.spec.uses_shared_pool else None))
        self.converters = self._build_converters()
        replayed = self.method.replay_source(self.hacpo)
        if replayed is not None:  # a recorded agent stands in for a live peer (replay.py); one live agent
            self.replay_peer = RecordedPeer(replayed)
            (learner,) = self.agents.values()
            self.converters[(self.replay_peer.key, learner.spec.name)] = self._converter(
                self.replay_peer.tokenizer, self.replay_peer.eos_token_ids, learner)
        workers = exchange_workers(self.config.trainer.get("exchange_workers"), len(self.specs))
        if workers:
            self.conversion_jobs = ConversionJobs(dict(self.converters), decode_responses, workers)

    def _shared_pool(self):
        if not any(s.uses_shared_pool for s in self.specs):
            return None
        # several agents' workers are placed on the same bundles and take turns (placement.py)
        return make_pool(request_for(self.config, self.specs, "shared", self.device_name), self.config, self.device_name)

    def _build_converters(self) -> dict[tuple[str, str], RowConverter]:
        """One converter per (source, learner) pair; its widths are the learner's rollout limits."""
        return {
            (source.spec.name, learner.spec.name): self._converter(source.tokenizer, source.eos_token_ids, learner)
            for learner in self.agents.values()
            for source in self.agents.values()
        }

    def _converter(self, source_tokenizer, source_eos_ids: list[int], learner: AgentRuntime) -> RowConverter:
        rollout = learner.config.actor_rollout_ref.rollout
        template_kwargs = self.config.data.get("apply_chat_template_kwargs")
        return RowConverter(
            source_tokenizer,
            learner.tokenizer,
            source_eos_ids=source_eos_ids,
            max_prompt_length=int(rollout.prompt_length),
            max_response_length=int(rollout.response_length),
            chat_template_kwargs=OmegaConf.to_container(template_kwargs, resolve=True) if template_kwargs else {},
        )

    def for_each_agent(self, fn: Callable[[AgentRuntime], T], phase: str | None = None) -> dict[str, T]:
        """Run `fn` for every agent: concurrently across own pools, in turn on the shared pool.

        With `phase`, each agent's own time is recorded as `agent/<name>/timing_s/<phase>`.
        """

        def timed(agent: AgentRuntime) -> T:
            start = time.perf_counter()
            out = fn(agent)
            if phase:
                pad_phase(self.device_pads, agent.spec.name, phase, start)
                self.agent_timing[agent_key(agent.spec.name, f"timing_s/{phase}")] = time.perf_counter() - start
            return out

        futures = {n: self._pool.submit(timed, a) for n, a in self.agents.items() if not a.spec.uses_shared_pool}
        calls = {n: (lambda a=a: timed(a)) for n, a in self.agents.items() if a.spec.uses_shared_pool}
        calls.update({n: fut.result for n, fut in futures.items()})
        results = {}
        for name in self.agents:
            try:
                results[name] = calls[name]()
            except Exception as exc:
                # a failed Ray call says which actor died, not which agent it served
                raise AgentError(name, describe_failure(exc)) from exc
        return results

    # ================================================================== one step (spec §7)
    def train_step(self, batch_dict: dict) -> dict[str, float]:
        metrics: dict[str, float] = {}
        timing: dict[str, float] = {}
        self.agent_timing = {}
        phase = self._phase_timer(timing)
        prompts = self._prompt_batch(batch_dict)
        with self._background_exchange(timing):  # conversions run from generate to the exchange
            with phase("gen"):
                rollouts = self.generate(prompts)
            with phase("reward"):
                self.score(rollouts, metrics)
            with phase("old_log_prob"):
                self.old_log_probs(rollouts, metrics)
            record_dir = self.config.trainer.get("record_rollouts_dir")
            if record_dir:  # for a later run that replays one of these agents (replay.py)
                with phase("record"):
                    record_rollouts(str(record_dir), self.global_step, rollouts, self.specs)
            self.update_capabilities(rollouts, metrics)
            with phase("exchange"):
                batches = self.exchange(rollouts, metrics)
        with phase("adv"):
            self.advantages(batches, metrics)
        if any(a.use_ref for a in self.agents.values()):
            with phase("ref"):
                self.ref_log_probs(batches)
        with phase("update_actor"):
            self.update(batches, metrics)
        rollout_dir = self.config.trainer.get("rollout_data_dir")
        if rollout_dir:  # what sharing did, row by row (rollout_log.py)
            with phase("rollout_log"):
                self.log_rollouts(str(rollout_dir), batches)
        with phase("update_weights"):
            self.sync_weights()
        metrics.update({f"timing_s/{k}": v for k, v in timing.items()})
        metrics.update(self.agent_timing)
        return metrics

    @contextmanager
    def _background_exchange(self, timing: dict[str, float]):
        """The step's background conversions (exchange/jobs.py) around generate … exchange.

        On leaving: every job of the step is joined, so a failed conversion the step did not ask
        for still stops it before the update; on a failure, what has not started is cancelled, so
        nothing of this step runs into the next. Records `exchange_wait` (what the exchange phase
        still waited for; `exchange` is the whole phase) and `exchange_background` (the jobs' own
        seconds, mostly hidden behind scoring and old log-probs).
        """
        jobs = self.conversion_jobs
        if jobs is None:
            yield
            return
        jobs.begin_step(self.global_step)
        try:
            yield
            jobs.check()
        except BaseException:
            jobs.abandon()
            raise
        timing["exchange_wait"] = jobs.wait_s
        timing["exchange_background"] = jobs.busy_s

    def _phase_timer(self, timing: dict[str, float]):
        """`with phase(name):` times a phase into `timing` and first announces it (`_announce`)."""

        @contextmanager
        def phase(name: str):
            self._safe_point(name)
            self._announce(name)
            with simple_timer(name, timing):  # adds to timing[name]; each phase runs once a step
                yield

        return phase

    def _announce(self, phase: str) -> None:
        """With `trainer.progress_file` set, rewrite it (atomically) as {"step", "phase", "time",
        "workers": {agent: ["host:pid", ...]}}.

        For watchdogs on long runs (which phase is a stuck run in, which processes serve which
        agent?) and for the tests that kill a run, or one agent's worker, at a chosen phase.
        """
        if self.progress_lines is not None:
            self.progress_lines.phase(self.global_step, phase)
        path = self.config.trainer.get("progress_file")
        if path:
            if self._worker_processes is None:
                self._worker_processes = {n: a.worker_processes() for n, a in self.agents.items()}
            record = {"step": self.global_step, "phase": phase, "time": time.time(), "workers": self._worker_processes}
            atomic_write_text(str(path), json.dumps(record))

    def _prompt_batch(self, batch_dict: dict) -> DataProto:
        prompts = DataProto.from_single_dict(batch_dict)
        # one uid per prompt: a group is every agent's answers to it (spec §2); named by step
        # and row rather than at random so that a resumed run builds the same batches
        prompts.non_tensor_batch["uid"] = np.array(
            [f"step{self.global_step}-prompt{i}" for i in range(len(prompts))], dtype=object
        )
        return prompts

    # ------------------------------------------------------------------ 1 generate
    def generate(self, prompts: DataProto) -> dict[str, DataProto]:
        return self.for_each_agent(lambda a: self._rollouts_ready(a, a.generate(prompts, step=self.global_step)), phase="gen")

    def _rollouts_ready(self, agent: AgentRuntime, batch: DataProto) -> DataProto:
        """Start, in the background, the decoding of `agent`'s responses and their conversion for
        every learner that will take them this step (exchange/jobs.py)."""
        jobs = self.conversion_jobs
        if jobs is not None:
            jobs.start(agent.spec.name, batch, self._peer_learners(agent.spec.name), agent.tokenizer)
            if self.replay_peer is not None:  # the recording of this step, checked against these prompts
                peer, step = self.replay_peer, self.global_step
                jobs.start(peer.key, lambda: peer.load(step, batch), [agent.spec.name], peer.tokenizer)
        return batch

    def _peer_learners(self, source: str) -> list[str]:
        """The learners whose batches may hold `source`'s rows re-tokenized (the method's say)."""
        return self.method.peer_learners(self.specs, self.hacpo, source)

    # ------------------------------------------------------------------ 2 score
    def score(self, rollouts: dict[str, DataProto], metrics: dict) -> None:
        jobs = self.conversion_jobs
        for name, batch in rollouts.items():
            # the text decoded in the background as the rollouts returned (the same function)
            texts = jobs.texts(name) if jobs is not None and jobs.started(name) else None
            metrics.update(prefixed({name: self.score_rollouts(name, batch, texts)}))

    def score_rollouts(self, name: str, batch: DataProto, texts=None) -> dict[str, float]:
        """The verifier's rewards of `name`'s rollouts, attached to `batch`; their metrics (below agent/<name>/)."""
        outcome = self.verifier.score(batch, self.agents[name].tokenizer, texts=texts)
        attach_rewards(batch, outcome)
        return {
            "reward/mean": float(outcome.rewards.mean()), "reward/errors": float(outcome.errors),
            "reward/timeouts": float(outcome.timeouts), "reward/nonfinite": float(outcome.nonfinite),
            "response_length/mean": float(batch.batch["response_mask"].sum(-1).float().mean()),
        }

    # ------------------------------------------------------------------ 3 old log-probs
    def old_log_probs(self, rollouts: dict[str, DataProto], metrics: dict) -> None:
        old = self.for_each_agent(lambda a: a.old_log_prob(rollouts[a.spec.name]), phase="old_log_prob")
        for name, batch in rollouts.items():
            attach_old_log_probs(name, batch, old[name])
        self.check_rollout_policy(rollouts, metrics)

    def check_rollout_policy(self, rollouts: dict[str, DataProto], metrics: dict, step: int | None = None) -> None:
        """The engine's log-probs of the tokens it sampled against the actor's old log-probs
        (recipe_hacpo/rollout_check.py): apart from numerics they differ only when the engine
        runs other weights than the actor. Out of `trainer.rollout_check`'s limits, the run
        stops here, before any update, or warns. `step`: the step a message names (default: the
        trainer's; an asynchronous agent's own step)."""
        step = self.global_step if step is None else step
        failures = []
        for name, batch in rollouts.items():
            if "rollout_log_probs" not in batch.batch.keys():
                continue  # config.py refuses a checking action without the engine's log-probs
            stats = mismatch_stats(batch.batch["rollout_log_probs"], batch.batch["old_log_probs"],
                                   batch.batch["response_mask"])
            if stats.tokens == 0:
                continue
            metrics[agent_key(name, "rollout/log_prob_diff_max")] = stats.max_abs
            metrics[agent_key(name, "rollout/log_prob_diff_mean")] = stats.mean_abs
            if not math.isnan(stats.pearson):
                metrics[agent_key(name, "rollout/log_prob_pearson")] = stats.pearson
            precision = agent_precision(self.agents[name].config)
            violated = violations(stats, self.rollout_check.limits(precision), self.rollout_check.min_tokens)
            metrics[agent_key(name, "rollout/policy_mismatch")] = float(bool(violated))
            if violated and self.rollout_check.action != "off":
                failures.append((name, mismatch_message(step, precision, stats, violated)))
        if failures and self.rollout_check.action == "stop":
            name, message = failures[0]
            raise RolloutMismatchError(name, f"{message}; stopped before the update ({ROLLOUT_CHECK_PATH}.action=warn trains on)")
        for name, message in failures:
            print(f"WARN: agent {name!r}: {message}; training on ({ROLLOUT_CHECK_PATH}.action=warn)", file=sys.stderr, flush=True)

    def update_capabilities(self, rollouts: dict[str, DataProto], metrics: dict) -> None:
        self.tracker.update([float(rollouts[s.name].batch[K.REWARD].mean()) for s in self.specs])
        caps = self.tracker.capabilities()
        for s in self.specs:
            metrics[agent_key(s.name, "capability")] = float(caps[s.index])

    # ------------------------------------------------------------------ 4 exchange
    def exchange(self, rollouts: dict[str, DataProto], metrics: dict) -> dict[str, DataProto]:
        """Learner batches from the step's rollouts, as the method builds them from the step's
        context (recipe_hacpo/methods/); its per-agent metrics land under agent/<name>/."""
        batches, agent_metrics = self.method.exchange(self.step_context(), rollouts)
        metrics.update(prefixed(agent_metrics))
        return batches

    def advantages(self, batches: dict[str, DataProto], metrics: dict) -> None:
        """Every learner row's advantage, as the method defines it (HACPO: §2's capability-aware
        group advantage)."""
        metrics.update(prefixed(self.method.advantages(self.step_context(), batches)))

    def step_context(self) -> StepContext:
        """What a method sees of this step (methods/context.py): data, and these operations."""
        return StepContext(
            specs=tuple(self.specs),
            settings=self.hacpo,
            effective=self.effective,
            step=self.global_step,
            capabilities=self.tracker.capabilities(),
            seed_of=lambda name: int(self.agents[name].config.actor_rollout_ref.actor.data_loader_seed),
            convert=self.convert_rows,
            old_log_probs_of_rows=self.old_log_probs_of_rows,
            recorded_peer=self.recorded_rows if self.replay_peer is not None else None,
        )

    def convert_rows(self, source: str, learner: str, batch: DataProto, rows: torch.Tensor | None = None) -> DataProto:
        """`source`'s rows (all, or `rows` of them) in `learner`'s tokenization: from the background
        jobs when they started this source, else converted here and now (the serial path:
        `trainer.exchange_workers=0`, trainers assembled without init_workers)."""
        jobs = self.conversion_jobs
        if jobs is not None and jobs.started(source):
            return jobs.convert(source, learner, batch, rows)
        return self.converters[(source, learner)].convert(batch if rows is None else batch.select_idxs(rows))

    def old_log_probs_of_rows(self, requests: dict[str, tuple[DataProto, torch.Tensor]], phase: str) -> dict:
        """Each learner's old log-probs of some rows of its batch ({name: (batch, rows)}), timed as `phase`."""
        return self.for_each_agent(
            lambda a: a.old_log_prob_of_rows(*requests[a.spec.name]) if a.spec.name in requests else None, phase=phase)

    def recorded_rows(self, live: DataProto) -> RecordedRows:
        """The recorded peer's rows of this step (replay.py), scored: loaded, checked, decoded and
        converted in the background since the live rollouts returned, or here and now."""
        peer, jobs = self.replay_peer, self.conversion_jobs
        background = jobs is not None and jobs.started(peer.key)
        # checked against the live prompts (R1) by `load`, in the background or here
        recorded = jobs.batch(peer.key) if background else peer.load(self.global_step, live)
        texts = jobs.texts(peer.key) if background else None
        attach_rewards(recorded, self.verifier.score(recorded, peer.tokenizer, texts=texts))  # re-scored (R2)
        return RecordedRows(key=peer.key, rollout_n=peer.rollout_n, batch=recorded)

    def ref_log_probs(self, batches: dict[str, DataProto]) -> None:
        ref = self.for_each_agent(lambda a: a.ref_log_prob(batches[a.spec.name]) if a.use_ref else None, phase="ref")
        for name, lp in ref.items():
            if lp is not None:
                batches[name].batch["ref_log_prob"] = lp

    def update(self, batches: dict[str, DataProto], metrics: dict) -> None:
        method = self.method
        for name, batch in batches.items():
            check_learner_batch(name, batch, self.global_step)
        self._dump_learner_batches(batches)
        order = partial(method.mini_batch_order, self.hacpo)
        out = self.for_each_agent(
            lambda a: a.update(batches[a.spec.name], method.rows_per_prompt(self.specs, a.spec, self.hacpo), order=order),
            phase="update_actor",
        )
        for name, agent_metrics in out.items():
            metrics.update(prefixed({name: self.update_metrics(name, agent_metrics)}))

    def update_metrics(self, name: str, agent_metrics: dict[str, float]) -> dict[str, float]:
        """One agent's update metrics, checked, with the method's step figures, named below
        agent/<name>/: verl's worker reports loss, grad_norm, lr, perf/... bare, kept under actor/."""
        method = self.method
        groups = ("actor/", "hacpo/", *method.metric_groups)
        agent_metrics = dict(agent_metrics)
        agent_metrics.update(check_update_metrics(name, agent_metrics))
        agent_metrics.update(method.step_metrics(agent_metrics))
        return {key if key.startswith(groups) else f"actor/{key}": value for key, value in agent_metrics.items()}

    def log_rollouts(self, root: str, batches: dict[str, DataProto]) -> None:
        """`trainer.rollout_data_dir`: each learner's rows of the step, with the ratio and clip
        each row met in the update (rollout_log.py)."""
        names = [s.name for s in self.specs]
        for name, batch in batches.items():
            agent = self.agents[name]
            rows = rollout_rows(name, self.global_step, batch, agent.tokenizer, names, agent.last_update_record)
            write_rollout_log(root, name, self.global_step, rows)

    def _dump_learner_batches(self, batches: dict[str, DataProto]) -> None:
        """With `trainer.learner_batch_dir` set, keep the exact batch each learner trains on."""
        folders = {self.dump_learner_batch(name, self.global_step, batch) for name, batch in batches.items()}
        for step_dir in folders - {None}:  # with the capability tracker the batches were made with
            torch.save(self.tracker.state_dict(), os.path.join(step_dir, "tracker.pt"))

    def dump_learner_batch(self, name: str, step: int, batch: DataProto) -> str | None:
        """`<trainer.learner_batch_dir>/step_<step>/<name>.pkl` when that key is set; the step's folder."""
        root = self.config.trainer.get("learner_batch_dir")
        if not root:
            return None
        step_dir = os.path.join(str(root), f"step_{step}")
        os.makedirs(step_dir, exist_ok=True)
        batch.save_to_disk(os.path.join(step_dir, f"{name}.pkl"))
        return step_dir

    # ------------------------------------------------------------------ 5 sync
    def sync_weights(self) -> None:
        # an agent of the shared pool is synced right before its own rollout (one replica awake
        # at a time); an agent of its own pool now, so its replica is ready when the step starts
        self.for_each_agent(lambda a: a.defer_sync(self.global_step) if a.spec.uses_shared_pool
                   else a.sync_weights(self.global_step), phase="update_weights")

    # ================================================================== validation
    def validate(self, only: str | None = None) -> dict[str, float]:
        """mean@k per agent and data source over the validation set (k = rollout.val_kwargs.n);
        `only`: of that one agent (asynchronous agents validate each at its own steps)."""
        if self.val_dataloader is None:
            return {}
        names = list(self.agents) if only is None else [only]
        sums: dict[str, dict[str, list[float]]] = {n: {} for n in names}
        keep_samples = int(self.config.trainer.get("log_val_generations", 0) or 0) > 0 and only is None
        samples: dict[str, list[tuple[str, str, float]]] = {n: [] for n in names}
        for batch_dict in self.val_batches():
            prompts = DataProto.from_single_dict(batch_dict)
            prompts.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(prompts))], dtype=object)
            if only is None:
                outputs = self.for_each_agent(lambda a: a.generate(prompts, validate=True, step=self.global_step))
            else:
                outputs = {only: self.agents[only].generate(prompts, validate=True, step=self.global_step)}
            for name, out in outputs.items():
                tokenizer = self.agents[name].tokenizer
                outcome = self.verifier.score(out, tokenizer)
                for src, r in zip(out.non_tensor_batch["data_source"], outcome.rewards.tolist()):
                    sums[name].setdefault(str(src), []).append(r)
                if keep_samples:
                    texts = (tokenizer.batch_decode(out.batch[k], skip_special_tokens=True) for k in ("prompts", "responses"))
                    samples[name] += zip(*texts, outcome.rewards.tolist())
        if keep_samples:  # logged with the validation's metrics (`_log`)
            self.val_samples = samples
        metrics = {}
        for name, per_source in sums.items():
            k = int(self.agents[name].config.actor_rollout_ref.rollout.val_kwargs.n)
            for src, values in per_source.items():
                metrics[agent_key(name, f"val/{src}/mean@{k}")] = float(np.mean(values))
        return metrics

    def val_batches(self):
        return self.val_dataloader

    # ================================================================== checkpoints
    @property
    def checkpoint_root(self) -> str:
        return str(self.config.trainer.default_local_dir)

    @functools.cached_property
    def identity(self) -> dict:
        """This run's identity (recipe_hacpo/training/run_identity.py), recorded in every checkpoint."""
        return run_identity(self.config, self.specs)

    def trainer_state(self) -> dict:
        """What a checkpoint holds besides the agents' workers: step, capability history, data
        position and RNGs (copied, so a snapshot taken between steps stays as it was)."""
        return {
            "global_step": self.global_step,
            "tracker": copy.deepcopy(self.tracker.state_dict()),
            "dataloader": copy.deepcopy(self.train_dataloader.state_dict()),
            "agents": [s.name for s in self.specs],
            "torch_rng": torch.get_rng_state(),
            "numpy_rng": np.random.get_state(),
        }

    def save_checkpoint(self, state: dict | None = None) -> str:
        """Write every agent and the trainer state to a temp dir, then publish it atomically.

        `state`: a `trainer_state()` taken earlier (the end of the last finished step, when the
        step after it is abandoned); its step must be the agents' current one.
        """
        state = self.trainer_state() if state is None else state
        step = int(state["global_step"])
        final = os.path.join(self.checkpoint_root, f"global_step_{step}")
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp, exist_ok=True)
        agent_steps = state.get("agent_steps", {})  # asynchronous agents: each at its own version
        for name, agent in self.agents.items():
            try:
                agent.save(os.path.join(tmp, name), int(agent_steps.get(name, step)))
            except Exception as exc:
                # the temp dir stays torn and is never published; the previous checkpoint stays latest
                raise AgentError(name, f"checkpoint of step {step} failed: {describe_failure(exc)}") from exc
        write_identity(tmp, self.identity)  # what trained it: a resume by another run is refused
        torch.save(state, os.path.join(tmp, STATE_FILE))
        replace_dir(tmp, final)
        atomic_write_text(os.path.join(self.checkpoint_root, LATEST_FILE), str(step))
        keep = self.config.trainer.get("max_actor_ckpt_to_keep")
        for name in prune_checkpoints(self.checkpoint_root, keep, list(self.agents)):
            print(f"hacpo: removed checkpoint {name} (trainer.max_actor_ckpt_to_keep={keep})", flush=True)
        return final

    def load_checkpoint(self) -> bool:
        """Resume from the latest complete checkpoint, if `trainer.resume_mode` allows."""
        names = [s.name for s in self.specs]
        choice = checkpoint_to_resume(self.config.trainer, names)
        for torn in choice.skipped:
            print(f"WARN: skipping incomplete checkpoint {torn}", flush=True)
        if choice.path is None:
            return False
        path = choice.path
        try:
            state = torch.load(os.path.join(path, STATE_FILE), weights_only=False)
        except Exception as exc:
            raise CheckpointError(f"checkpoint {path}: {STATE_FILE} unreadable ({type(exc).__name__}: {exc})") from exc
        if state["agents"] != names:
            raise CheckpointError(f"checkpoint {path}: agents {state['agents']} differ from this run's {names}")
        if ("async" in state) != self.asynchronous:
            written, resume = ("an asynchronous", "true") if "async" in state else ("a lockstep", "false")
            raise CheckpointError(f"checkpoint {path}: written by {written} run; resume it with trainer.async.enable={resume}")
        agent_steps = state.get("agent_steps", {})
        for name, agent in self.agents.items():
            agent.load(os.path.join(path, name), int(agent_steps.get(name, state["global_step"])))
        self.loaded_state = state
        if not self.asynchronous:  # an asynchronous run's capabilities are its own (AsyncHacpoTrainer)
            self.tracker.load_state_dict(state["tracker"])
        self.train_dataloader.load_state_dict(state["dataloader"])
        torch.set_rng_state(state["torch_rng"])
        np.random.set_state(state["numpy_rng"])
        self.global_step = int(state["global_step"])
        return True

    # ================================================================== stopping to be resumed
    def _safe_point(self, next_phase: str) -> None:
        """Between two phases of a step: while a stop is wanted (a signal) or a deadline is near,
        decide once per step to finish it or to abandon it (StepAbandoned), and say which and why."""
        if self._step_started is None or self._step_decision == "finish":
            return
        decision = self.stop_clock.finish_or_abandon(
            self.stop_signals.first, next_phase, time.perf_counter() - self._step_started
        )
        if decision is None:
            return
        verdict, why = decision
        self._step_decision = verdict
        if verdict == "finish":
            print(f"hacpo: step {self.global_step}: finishing it before the checkpoint: {why}", flush=True)
            return
        print(f"hacpo: step {self.global_step}: abandoning it before {next_phase}, nothing of it is saved: {why}",
              flush=True)
        raise StepAbandoned(why)

    def _stop_for_resume(self, reason: str, saved_step: int | None, state: dict | None) -> None:
        """Publish a complete checkpoint of the last finished step (unless it is already the
        newest one), record the stop, and raise ResumableStop."""
        step = self.global_step if state is None else int(state["global_step"])
        if step > 0 and saved_step != step:
            self._announce("save_checkpoint")
            start = time.perf_counter()
            self.save_checkpoint(state)
            print(f"hacpo: checkpoint of step {step} written in {time.perf_counter() - start:.1f} s", flush=True)
        if self.stop_signals.received[1:]:
            later = ", ".join(name for name, _ in self.stop_signals.received[1:])
            print(f"hacpo: {later} during the stop: ignored, the checkpoint of step {step} is complete", flush=True)
        self._announce("stopped")
        record = self.preemption.record_file
        if record:
            os.makedirs(os.path.dirname(os.path.abspath(record)), exist_ok=True)
            atomic_write_text(record, json.dumps({
                "resumed_from": self.resumed_from, "step": step, "reason": reason,
                "signals": [name for name, _ in self.stop_signals.received],
            }))
        raise ResumableStop(step, reason)

    def _deadline_in_advance(self) -> float | None:
        """The earliest of the Slurm job's end time and start + trainer.preemption.time_limit_s."""
        ends = []
        if self.preemption.slurm_end_time:
            end = slurm_end_time()
            if end is not None:
                ends.append(end)
        if self.preemption.time_limit_s is not None:
            ends.append(self.started_at + self.preemption.time_limit_s)
        return min(ends) if ends else None

    # ================================================================== the loop
    def _log(self, logger, metrics: dict[str, float]) -> None:
        """The step's metrics, and the validation samples `trainer.log_val_generations` asks
        for when this step validated (run_metrics.RunMetrics.log_generations)."""
        logger.log(data=metrics, step=self.global_step)
        if self.val_samples:
            logger.log_generations(self.val_samples, int(self.config.trainer.log_val_generations), self.global_step)
            self.val_samples = {}

    def fit(self, logger, progress: bool = True, summary_every: int = 0) -> dict[str, float]:
        """Validate, train `total_steps` steps, validate/save on their schedule; returns the last
        step's metrics. Every metric goes to `logger`; with `summary_every` > 0, one short line
        per agent is written under the progress bar every that many steps and at the last.

        Raises ResumableStop after a stop asked for by a signal or a deadline (preemption.py),
        once a complete checkpoint of the last finished step is published."""
        run = self._resume()
        t = self.config.trainer
        if t.get("val_only", False):  # validate the initial (or resumed) agents, train nothing
            return self._validate_only(logger)
        if t.get("val_before_train", True) and not run.resumed:
            self._validate_before_training(logger, run, summary_every)
        bar = self._progress(progress)
        try:
            for batch_dict in self._batches(run):
                metrics = self._step(batch_dict, run)
                done = self.global_step >= self.total_steps
                self._validate_and_save(metrics, run, done)
                self._announce("step_done")
                self._log(logger, metrics)
                run.last = metrics
                run.latest.update(metrics)
                self._show_progress(bar, run, summary_every, done)
                if done:
                    break
                run.finished_state = self.trainer_state()
        finally:
            bar.close()
            if self.progress_lines is not None:
                self.progress_lines.close()
            self.verifier.close()
        return run.last

    def _resume(self) -> "_Run":
        """Load the latest checkpoint (as trainer.resume_mode allows) and set the stop clock."""
        resumed = self.load_checkpoint()
        self.resumed_from = self.global_step
        self.stop_clock = StopClock(self.preemption, end_time=self._deadline_in_advance())
        if self.stop_clock.end_time is not None:
            left = self.stop_clock.end_time - time.time()
            print(f"hacpo: stopping to be resumed before the deadline in {left:.0f} s", flush=True)
        return _Run(resumed=resumed, saved_step=self.global_step if resumed else None)

    def _validate_only(self, logger) -> dict[str, float]:
        from tqdm import tqdm

        val = self.validate()
        self._log(logger, val)
        tqdm.write(summary_lines(val, self.global_step, self.total_steps))
        return val

    def _validate_before_training(self, logger, run: "_Run", summary_every: int) -> None:
        from tqdm import tqdm

        print("hacpo: validating the agents before training", flush=True)
        val = self.validate()
        run.latest.update(val)
        self._log(logger, val)
        if summary_every > 0:
            tqdm.write(summary_lines(run.latest, self.global_step, self.total_steps))

    def _progress(self, progress: bool):
        """A bar on a terminal; elsewhere (a Slurm .out, a redirected log) plain lines that no
        carriage return rewrites (progress.py)."""
        from tqdm import tqdm

        on_terminal = sys.stderr.isatty()
        if progress and not on_terminal:
            self.progress_lines = ProgressLines(self.total_steps, self.global_step)
        return tqdm(total=self.total_steps, initial=self.global_step, desc="HACPO", disable=not (progress and on_terminal))

    def _batches(self, run: "_Run"):
        """The training batches, epoch after epoch, until total_steps; before each one, a stop
        asked for (a signal, a deadline) stops the run to be resumed (`_stop_for_resume`)."""
        while self.global_step < self.total_steps:
            batches = iter(self.train_dataloader)
            while True:
                reason = self.stop_clock.stop_before_step(self.stop_signals.first)
                if reason is not None:
                    print(f"hacpo: stopping before step {self.global_step + 1}: {reason}", flush=True)
                    self._stop_for_resume(reason, run.saved_step, run.finished_state)
                try:
                    batch_dict = next(batches)
                except StopIteration:
                    break
                yield batch_dict

    def _step(self, batch_dict: dict, run: "_Run") -> dict[str, float]:
        """One training step, timed; a step abandoned for a stop leaves no trace and stops the run."""
        self.global_step += 1
        self._step_decision = None
        start = self._step_started = time.perf_counter()
        try:
            metrics = self.train_step(batch_dict)
        except StepAbandoned as abandoned:
            # nothing of the step reached a weight; roll the capability history back
            self.global_step -= 1
            if run.finished_state is not None:
                self.tracker.load_state_dict(copy.deepcopy(run.finished_state["tracker"]))
            self._stop_for_resume(abandoned.reason, run.saved_step, run.finished_state)
        finally:
            self._step_started = None
        metrics["timing_s/step"] = time.perf_counter() - start
        self.stop_clock.note_step(metrics["timing_s/step"])
        metrics["training/global_step"] = self.global_step
        return metrics

    def _validate_and_save(self, metrics: dict[str, float], run: "_Run", done: bool) -> None:
        """Validation every trainer.test_freq steps and checkpoints every save_freq, both at the last."""
        t = self.config.trainer
        if t.test_freq > 0 and (self.global_step % t.test_freq == 0 or done):
            if self.stop_signals.first is not None and not done:
                print(f"hacpo: step {self.global_step}: validation skipped, stopping", flush=True)
            else:
                self._announce("validate")
                metrics.update(self.validate())
        if t.save_freq > 0 and (self.global_step % t.save_freq == 0 or done):
            self._announce("save_checkpoint")
            saving = time.perf_counter()
            self.save_checkpoint()
            self.stop_clock.note_checkpoint(time.perf_counter() - saving)
            run.saved_step = self.global_step

    def _show_progress(self, bar, run: "_Run", summary_every: int, done: bool) -> None:
        bar.update(1)
        if self.progress_lines is not None:
            self.progress_lines.step_done(self.global_step, run.last["timing_s/step"])
        if summary_every > 0 and (self.global_step % summary_every == 0 or done):
            bar.write(summary_lines(run.latest, self.global_step, self.total_steps))


PADDED_PHASES = ("gen", "old_log_prob", "ref", "update_actor", "update_weights")


def attach_old_log_probs(name: str, batch: DataProto, log_probs: torch.Tensor) -> None:
    """The actor's log-probs of `name`'s own rollouts as their old log-probs, with the per-row
    summaries a peer's exchange reads (SOURCE_*); non-finite values stop the run before any update."""
    mask = batch.batch["response_mask"]
    if not torch.isfinite(log_probs[mask.bool()]).all():
        raise FloatingPointError(f"agent {name!r}: non-finite old log-probs; stopping before any update")
    batch.batch["old_log_probs"] = log_probs
    batch.batch[K.SOURCE_LOG_PROB_MEAN] = mean_log_prob_per_response(log_probs, mask)
    batch.batch[K.SOURCE_RESPONSE_LENGTH] = mask.sum(-1).float()


def device_pads(trainer_cfg: DictConfig, names: list[str]) -> dict[str, dict[str, float]]:
    """`trainer.device_pad_s` checked ({agent: {phase: seconds}}); a ConfigError naming the key."""
    from recipe_hacpo.config import ConfigError

    raw = trainer_cfg.get("device_pad_s") or {}
    raw = OmegaConf.to_container(raw, resolve=True) if isinstance(raw, DictConfig) else dict(raw)
    pads: dict[str, dict[str, float]] = {}
    for name, phases in raw.items():
        if name not in names:
            raise ConfigError(f"trainer.device_pad_s.{name}: no such agent (agents: {', '.join(names)})")
        for phase, seconds in (phases or {}).items():
            if phase not in PADDED_PHASES:
                raise ConfigError(f"trainer.device_pad_s.{name}.{phase}: not a device phase ({', '.join(PADDED_PHASES)})")
            if not isinstance(seconds, (int, float)) or seconds < 0:
                raise ConfigError(f"trainer.device_pad_s.{name}.{phase}: must be seconds >= 0, got {seconds!r}")
            pads.setdefault(name, {})[phase] = float(seconds)
    return pads


def pad_phase(pads: dict[str, dict[str, float]], agent: str, phase: str, started: float) -> None:
    """Benchmarks only (`trainer.device_pad_s`): sleep until `agent`'s `phase`, started at
    `started` (perf_counter), has lasted its set seconds, as if a device had worked that long."""
    wanted = pads.get(agent, {}).get(phase)
    if wanted is not None:
        left = wanted - (time.perf_counter() - started)
        if left > 0:
            time.sleep(left)


@dataclass
class _Run:
    """What `fit` carries from step to step."""

    resumed: bool
    saved_step: int | None  # newest step with a complete checkpoint
    finished_state: dict | None = None  # trainer_state() at the end of the last finished step
    latest: dict = field(default_factory=dict)  # newest value of every metric, validation included
    last: dict = field(default_factory=dict)  # the last step's metrics


def summary_lines(metrics: dict[str, float], step: int, total: int) -> str:
    """One short line per agent from `agent/<name>/...` metrics: on-policy reward, the newest
    held-out accuracy (mean over validation sources), ω of each peer, cross rows used."""
    agents: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        split = agent_of(key)
        if split is not None:
            agents.setdefault(split[0], {})[split[1]] = value
    lines = []
    for name, m in agents.items():
        fields = []
        if "reward/mean" in m:
            fields.append(f"reward {m['reward/mean']:.3f}")
        val = [v for k, v in m.items() if k.startswith("val/") and "/mean@" in k]
        if val:
            fields.append(f"val acc {100 * float(np.mean(val)):.1f}%")
        omegas = [f"{k.split('/', 1)[1]} {v:.2f}" for k, v in m.items() if k.startswith("omega/")]
        if omegas:
            fields.append("ω " + ", ".join(omegas))
        if "cross/rows" in m:
            chosen = f" ({int(m['cross/rows_selected'])} selected)" if "cross/rows_selected" in m else ""
            fields.append(f"cross rows {int(m['cross/rows'])}{chosen}")
        lines.append(f"step {step}/{total} {name}: " + "  ".join(fields))
    return "\n".join(lines)
