"""Stopping to be resumed: a signal or a deadline known in advance makes the trainer write a
complete checkpoint and exit with RESUMABLE_EXIT, so a batch script can requeue the job and the
next run resumes from that checkpoint (trainer.resume_mode=auto) with nothing lost.

    RESUMABLE_EXIT      the exit status that means "stopped, checkpointed, resume me": 75
    PreemptionSettings  the trainer.preemption keys, checked before Ray starts
    StopSignals         SIGUSR1/SIGTERM handlers that only record; the loop acts at safe points
    shield_children     SIGUSR1 blocked while local Ray processes are forked (they inherit it)
    slurm_end_time      the Slurm job's end time (SLURM_JOB_END_TIME, else squeue)
    StopClock           when to stop: before a step, or finish-or-abandon the step in flight
    ResumableStop       raised by the trainer once the checkpoint is published

Why the trainer acts only at safe points: a signal handler that raised would tear whatever was
running, a checkpoint write included; this one appends to a list and the loop reads it between
phases. A step is abandoned only before its update begins (nothing of it has reached a weight,
an optimizer or the capability history that the checkpoint does not roll back); once the update
has begun the step is finished, whatever the time left.
"""

from __future__ import annotations

import datetime as _dt
import os
import signal
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

# sysexits.h EX_TEMPFAIL, "temporary failure; the user is invited to retry": clear of 0 (done),
# 1 (failed), 2 (bad configuration), 124 (timeout(1)), 128+n (killed by signal n: 130, 137, 143)
RESUMABLE_EXIT = 75

# the phases of a step after which nothing can be rolled back: the update changes weights and
# optimizer state, the weight sync follows it
_POINT_OF_NO_RETURN = ("update_actor", "update_weights")


class ResumableStop(Exception):
    """The run stopped early with a complete checkpoint of `step`; exit RESUMABLE_EXIT."""

    def __init__(self, step: int, reason: str) -> None:
        super().__init__(f"stopped to be resumed at step {step}: {reason}")
        self.step = step
        self.reason = reason


# ------------------------------------------------------------------------------ settings


@dataclass(frozen=True)
class PreemptionSettings:
    """trainer.preemption, as read from the composed config; each key is declared once, with
    its default and meaning, in configs/hacpo_base.yaml."""

    usr1_grace_s: float
    term_grace_s: float
    time_limit_s: float | None
    slurm_end_time: bool
    margin_s: float
    record_file: str | None
    request_file: str | None

    @classmethod
    def from_config(cls, trainer_cfg) -> "PreemptionSettings":
        """Read and check trainer.preemption; a bad value is one ConfigError line naming the key."""
        from recipe_hacpo.hacpo_settings import ConfigError

        raw = trainer_cfg.get("preemption")
        if raw is None:
            raise ConfigError("trainer.preemption: missing (declared in configs/hacpo_base.yaml)")
        known = list(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ConfigError(f"trainer.preemption.{unknown[0]}: unknown key; known: {', '.join(known)}")
        missing = [k for k in known if k not in raw]
        if missing:
            raise ConfigError(f"trainer.preemption.{missing[0]}: missing (declared in configs/hacpo_base.yaml)")
        values: dict = {}
        for key in ("usr1_grace_s", "term_grace_s", "margin_s", "time_limit_s"):
            value = raw[key]
            if value is None and key == "time_limit_s":
                values[key] = None
                continue
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise ConfigError(f"trainer.preemption.{key}={value!r}: not a number of seconds") from None
            bad = not number > 0 if key == "time_limit_s" else not number >= 0
            if bad or number == float("inf"):
                raise ConfigError(f"trainer.preemption.{key}={value!r}: must be "
                                  + ("> 0 seconds (or null for none)" if key == "time_limit_s" else ">= 0 seconds"))
            values[key] = number
        if not isinstance(raw["slurm_end_time"], bool):
            raise ConfigError(f"trainer.preemption.slurm_end_time={raw['slurm_end_time']!r}: must be true or false")
        values["slurm_end_time"] = raw["slurm_end_time"]
        for key in ("record_file", "request_file"):
            values[key] = str(raw[key]) if raw[key] else None
        return cls(**values)


# ------------------------------------------------------------------------------ signals


@dataclass
class StopSignals:
    """Handlers for SIGUSR1 and SIGTERM that record (name, time) and return.

    The first signal asks the trainer to stop; later ones are recorded and change nothing, so a
    second signal during the checkpoint write cannot tear it. Writes to stderr with os.write:
    print() from a handler can hit the buffered stream it interrupted.

    `request_file` (trainer.preemption.request_file): a launcher starts the trainer with SIGUSR1
    ignored, so that a stop request cannot kill it by the default action before these handlers
    are in place; a SIGUSR1 of those first seconds is then lost. The launcher writes this file
    with every SIGUSR1 it hands on, and `install` counts an existing one as a SIGUSR1 received.
    """

    signums: tuple[int, ...] = (signal.SIGUSR1, signal.SIGTERM)
    request_file: str | None = None
    received: list[tuple[str, float]] = field(default_factory=list)
    _previous: dict[int, object] = field(default_factory=dict)
    _request_seen: bool = False

    def install(self) -> "StopSignals":
        """Install (or re-install, over a handler something else put in their place) the
        handlers, then take up a stop request left in `request_file` before they were in place."""
        for signum in self.signums:
            previous = signal.signal(signum, self._handle)
            self._previous.setdefault(signum, previous)
        if self.request_file and not self._request_seen:
            try:
                sent = os.stat(self.request_file).st_mtime
            except OSError:
                sent = None
            if sent is not None:
                self._request_seen = True
                self._record("SIGUSR1", sent, "(sent before the trainer could catch it: "
                             f"{self.request_file})")
        return self

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        self._record(signal.Signals(signum).name, time.time())

    def _record(self, name: str, when: float, how: str = "") -> None:
        self.received.append((name, when))
        note = "stopping to be resumed at the next safe point" if len(self.received) == 1 else \
            "a stop is already under way; ignored"
        try:
            os.write(2, f"hacpo: {name} received{' ' + how if how else ''}: {note}\n".encode())
        except OSError:
            pass

    @property
    def first(self) -> tuple[str, float] | None:
        return self.received[0] if self.received else None


@contextmanager
def shield_children(signums: tuple[int, ...] = (signal.SIGUSR1,)) -> Iterator[None]:
    """Block `signums` in this thread while the body runs: processes it starts (a local Ray's
    GCS, raylet, dashboard; the raylet then forks every worker) inherit the blocked mask across
    fork and exec, so a SIGUSR1 sent to the trainer's whole process group (`kill -USR1 -PGID`,
    a launcher that signals its group) reaches only the trainer's handler and never ends a Ray
    process by its default action. A signal sent meanwhile stays pending and is delivered to the
    trainer when the block lifts. SIGTERM is left alone: Ray stops its own processes with it.
    """
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signums)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


# ------------------------------------------------------------------------------ deadlines


def parse_slurm_time(text: str) -> float | None:
    """squeue's %e (`2026-12-02T18:30:00`, local time) as epoch seconds; None for none/unknown."""
    text = text.strip()
    if not text or text.upper() in ("N/A", "NONE", "UNKNOWN", "UNLIMITED", "INVALID"):
        return None
    try:
        return _dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


def slurm_end_time(environ: dict | None = None, run: Callable = subprocess.run) -> float | None:
    """The end time of the Slurm job this process runs in (epoch seconds), None outside Slurm or
    when the job has no time limit. SLURM_JOB_END_TIME where Slurm sets it (23.02+), else
    `squeue -h -j $SLURM_JOB_ID -o %e`."""
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None
    end = env.get("SLURM_JOB_END_TIME", "").strip()
    if end.isdigit() and int(end) > 0:
        return float(end)
    try:
        proc = run(["squeue", "-h", "-j", str(job), "-o", "%e"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    return parse_slurm_time(proc.stdout.splitlines()[0] if proc.stdout.strip() else "")


@dataclass
class StopClock:
    """When to stop, from the deadlines known and the step and checkpoint times seen so far.

    Deadlines: `end_time` (known in advance: the Slurm job's end, or start + time_limit_s) and,
    once a signal has arrived, its time plus that signal's grace (what is left before the
    SIGKILL). The estimates are the slowest step and the slowest checkpoint write of this run;
    `margin_s` is kept free on top.
    """

    settings: PreemptionSettings
    end_time: float | None = None
    clock: Callable[[], float] = time.time
    slowest_step_s: float | None = None
    slowest_checkpoint_s: float | None = None

    def grace(self, signal_name: str) -> float:
        return self.settings.term_grace_s if signal_name == "SIGTERM" else self.settings.usr1_grace_s

    def deadline(self, signal_seen: tuple[str, float] | None) -> float | None:
        ends = [self.end_time] if self.end_time is not None else []
        if signal_seen is not None:
            ends.append(signal_seen[1] + self.grace(signal_seen[0]))
        return min(ends) if ends else None

    def note_step(self, seconds: float) -> None:
        self.slowest_step_s = max(seconds, self.slowest_step_s or 0.0)

    def note_checkpoint(self, seconds: float) -> None:
        self.slowest_checkpoint_s = max(seconds, self.slowest_checkpoint_s or 0.0)

    def checkpoint_estimate(self) -> float:
        # before the first write of this run: a step's time stands in for it
        if self.slowest_checkpoint_s is not None:
            return self.slowest_checkpoint_s
        return self.slowest_step_s or 0.0

    def stop_before_step(self, signal_seen: tuple[str, float] | None) -> str | None:
        """Why not to start the next step (a signal, or too little time before the deadline), or None."""
        if signal_seen is not None:
            return f"{signal_seen[0]} received"
        deadline = self.deadline(None)
        if deadline is None:
            return None
        left = max(deadline - self.clock(), 0.0)
        if self.slowest_step_s is None:
            # no step timed yet: stop only when the margin itself is no longer there
            return f"{left:.0f} s left before the deadline, under the margin" if left < self.settings.margin_s else None
        need = self.slowest_step_s + self.checkpoint_estimate() + self.settings.margin_s
        if left < need:
            return (f"{left:.0f} s left before the deadline, under the slowest step ({self.slowest_step_s:.0f} s) "
                    f"+ checkpoint ({self.checkpoint_estimate():.0f} s) + margin ({self.settings.margin_s:.0f} s)")
        return None

    def finish_or_abandon(self, signal_seen: tuple[str, float] | None, next_phase: str,
                          step_elapsed_s: float) -> tuple[str, str] | None:
        """At a phase boundary inside a step: None to carry on as usual, else ("finish" | "abandon", why).

        Asked only while a stop is wanted (a signal) or a deadline is near. Past the point of no
        return (the update has begun) the step is always finished.
        """
        deadline = self.deadline(signal_seen)
        if signal_seen is None:
            if deadline is None or self.slowest_step_s is None:
                return None
            rest = max(self.slowest_step_s - step_elapsed_s, 0.0)
            if deadline - self.clock() >= rest + self.checkpoint_estimate() + self.settings.margin_s:
                return None  # the deadline is not near yet
        if next_phase in _POINT_OF_NO_RETURN:
            return "finish", f"its update has begun ({next_phase} next); a half-updated step cannot be rolled back"
        if self.slowest_step_s is None:
            return "abandon", "no step of this run has finished yet, so nothing tells how long this one needs"
        left = max(deadline - self.clock(), 0.0) if deadline is not None else float("inf")
        rest = max(self.slowest_step_s - step_elapsed_s, 0.0)
        need = rest + self.checkpoint_estimate() + self.settings.margin_s
        if left >= need:
            return "finish", (f"{left:.0f} s left, enough for the rest of the step (<= {rest:.0f} s by the slowest "
                              f"step) + checkpoint ({self.checkpoint_estimate():.0f} s) + margin")
        return "abandon", (f"{left:.0f} s left, short of the rest of the step (<= {rest:.0f} s by the slowest step) "
                           f"+ checkpoint ({self.checkpoint_estimate():.0f} s) + margin ({self.settings.margin_s:.0f} s)")


class StepAbandoned(Exception):
    """Raised at a phase boundary to leave the step in flight; nothing of it is kept."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
