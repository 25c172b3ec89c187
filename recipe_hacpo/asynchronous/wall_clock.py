"""Run the agents' loops on the wall clock: one thread per agent, as a production run does.

Each thread drives its agent's loop (loop.py) and runs each phase as it comes: "device" work
holds the agent's pool (a lock per pool, so agents sharing one take turns), "state" work runs
under one lock (the schedule and the buffer see one agent at a time), "driver" work runs freely.
A `Park` waits until every live agent is parked, then one thread writes the joint checkpoint.
The threads block in Ray calls for real agents, so the GIL is not what limits them.

Timings are real seconds (time.perf_counter), in the same `Timeline` the virtual clock fills.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterator

from recipe_hacpo.asynchronous.loop import Park, Work
from recipe_hacpo.asynchronous.virtual_clock import Timeline


class WallClock:
    def __init__(self, pools: dict[str, str], on_checkpoint: Callable[[int, float], float] | None = None) -> None:
        self.pools, self.on_checkpoint = dict(pools), on_checkpoint

    def run(self, loops: dict[str, Iterator[Work | Park]]) -> Timeline:
        names = list(loops)
        tl = Timeline.for_agents(names, self.pools)
        pool_locks = {p: threading.Lock() for p in tl.pool_busy}
        state_lock = threading.Lock()
        meeting = threading.Condition()
        live = set(names)
        parked: set[str] = set()
        park_round = [0]  # the round of the checkpoint the parked agents wait for
        generation = [0]  # joint checkpoints written so far; a parked thread waits for it to move
        errors: list[BaseException] = []
        t0 = time.perf_counter()

        def checkpoint_if_all_parked() -> None:
            """Called with `meeting` held: the last agent to park (or to finish) writes the checkpoint."""
            round_ = park_round[0]
            if errors:
                meeting.notify_all()
                return
            if parked and parked >= live:
                if self.on_checkpoint is not None:
                    try:
                        self.on_checkpoint(round_, time.perf_counter() - t0)
                    except BaseException as exc:  # also where the last agent to finish called it
                        errors.append(exc)
                        meeting.notify_all()
                        return
                tl.checkpoints.append((round_, time.perf_counter() - t0))
                parked.clear()
                generation[0] += 1
                meeting.notify_all()

        def drive(name: str) -> None:
            loop, result = loops[name], None
            try:
                work = next(loop)
                while True:
                    if errors:  # another agent failed: the run stops at this agent's next phase
                        return
                    if isinstance(work, Park):
                        with meeting:
                            since, seen = time.perf_counter(), generation[0]
                            parked.add(name)
                            park_round[0] = work.round
                            checkpoint_if_all_parked()
                            while generation[0] == seen and not errors:
                                meeting.wait(0.5)
                            tl.checkpoint_wait[name] += time.perf_counter() - since
                        if errors:
                            return
                        result = None
                    else:
                        result = self._run_one(name, work, tl, pool_locks, state_lock, t0)
                    work = loop.send(result)
            except StopIteration:
                pass
            except BaseException as exc:  # the run stops; the first failure is raised by run()
                errors.append(exc)
            finally:
                with meeting:
                    live.discard(name)
                    checkpoint_if_all_parked()
                    meeting.notify_all()

        threads = [threading.Thread(target=drive, args=(n,), name=f"hacpo-async-{n}", daemon=True) for n in names]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            raise errors[0]
        tl.end = time.perf_counter() - t0
        return tl

    def _run_one(self, name, work: Work, tl: Timeline, pool_locks, state_lock, t0) -> object:
        if work.kind == "state":
            with state_lock:
                return work.run()
        if work.kind == "driver":
            return work.run()
        lock = pool_locks[self.pools[name]]
        asked = time.perf_counter()
        with lock:
            start = time.perf_counter()
            tl.pool_wait[name] += start - asked
            out = work.run()
            end = time.perf_counter()
        tl.device_work(name, self.pools[name], work.phase, end - start, end - t0)
        return out

