"""Progress a log file can hold: plain lines where no terminal shows a bar (a Slurm `.out`, a
redirected run). A step phase (generation, old log-probs, the update, ...) that runs longer than
`after_s` says so, and again every `every_s` while it lasts; every finished step prints one line
with its time, the run's elapsed time and an ETA. Nothing rewrites a line."""

from __future__ import annotations

import threading
import time
from typing import Callable


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressLines:
    def __init__(self, total_steps: int, first_step: int, *, after_s: float = 10.0, every_s: float = 60.0,
                 write: Callable[[str], None] | None = None):
        self.total, self.first = total_steps, first_step
        self.after_s, self.every_s = after_s, every_s
        self.write = write or (lambda line: print(line, flush=True))
        self.started = time.monotonic()
        self._phase: tuple[int, str, float] | None = None  # (step, name, started)
        self._told = 0.0  # when the running phase was last reported
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hacpo-progress", daemon=True)
        self._thread.start()

    def phase(self, step: int, name: str) -> None:
        with self._lock:
            self._phase = (step, name, time.monotonic())
            self._told = 0.0

    def step_done(self, step: int, step_s: float) -> None:
        with self._lock:
            self._phase = None
        elapsed = time.monotonic() - self.started
        done = step - self.first
        left = (self.total - step) * elapsed / done if done > 0 else 0.0
        self.write(f"hacpo: step {step}/{self.total} done in {step_s:.1f} s; elapsed {_clock(elapsed)}, "
                   f"ETA {_clock(left)}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.after_s / 2)):
            with self._lock:
                if self._phase is None:
                    continue
                step, name, since = self._phase
                now = time.monotonic()
                due = self.after_s if not self._told else self._told - since + self.every_s
                if now - since < due:
                    continue
                self._told = now
            self.write(f"hacpo: step {step}: {name} running for {now - since:.0f} s")
