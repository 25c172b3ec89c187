"""Run a function of some module under a wall-clock deadline, from any thread.

Pure-Python work (sympy) can be interrupted by ``SIGALRM``, but signal handlers only exist in
the main thread, and a thread cannot be killed. So:

- on the main thread, :func:`call_with_alarm` arms ``ITIMER_REAL`` around the call (restoring
  any timer and handler that were there before);
- on any other thread, the call goes to a small pool of worker processes running this file as
  a script; each worker applies the same alarm to itself, and the caller kills it if it has
  not answered shortly after the deadline (the only real bound on a call stuck in C code).
  Workers also cap their own address space, so a runaway allocation cannot take the host down.

The target module must be importable by file path with only third-party dependencies (no
package-relative imports). Functions receive and return JSON-serialisable values.

Why the worker runs an alarm *and* the caller holds a kill deadline: they bound different
failures. The alarm ends the common case (sympy busy in Python code) inside the worker, which
answers "timeout" and stays warm; the kill is the backstop for a call stuck in C code, and
costs a worker restart (interpreter + sympy import + `warmup`, about 0.5 s measured for
`equivalence.py` on a 2-core host). One mechanism alone loses one of the two.

Why not a process-pool library:
- `concurrent.futures.ProcessPoolExecutor` / `multiprocessing.Pool` have no per-task timeout
  that ends the task: a stuck call keeps its worker forever.
- `pebble.ProcessPool.schedule(timeout=)` ends an overrunning task by terminating its worker,
  i.e. the kill only: every timed-out sample would pay the restart above. It is built on
  `multiprocessing`, whose default `fork` start copies a multi-threaded Ray worker (unsafe),
  while `spawn`/`forkserver` re-import the parent's `__main__` in each worker (a Ray worker's
  entry module with Ray and the trainer's imports); the workers here start a bare interpreter
  on this file, load only the target by path and cap their own address space.
- No library covers the other two paths: the main thread needs no process at all (a
  `SIGALRM` bound), and where process creation is refused (some sandboxes) the call must fall
  back to a soft bound in a thread rather than fail every sample.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

KILL_GRACE_S = 0.5
"""How long after the deadline a silent worker process is given before it is killed."""

WORKER_START_TIMEOUT_S = 60.0
"""Upper bound on a worker process's start-up (interpreter, imports, warm-up)."""

WORKER_MEMORY_LIMIT_BYTES = 4 << 30
"""Address-space cap each worker process sets on itself."""

MAX_START_FAILURES = 3
"""After this many consecutive failed worker start-ups a pool is no longer used."""

_ALARM_REPEAT_S = 0.05
ISOLATION_MODES = ("auto", "process", "thread", "inline")


class DeadlineExceeded(BaseException):
    """Raised by the alarm handler; a BaseException so ``except Exception`` does not eat it."""


@dataclass(frozen=True)
class Outcome:
    status: str  # "ok" | "timeout" | "error"
    value: Any = None
    detail: str = ""


def on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")


def call_with_alarm(fn: Callable[..., Any], timeout_s: float, *args: Any) -> Outcome:
    """Call ``fn(*args)`` on the main thread, interrupting it after ``timeout_s`` seconds.

    After the first expiry the alarm keeps firing every 50 ms until the call unwinds, in case
    some library code swallows the first exception. The previous ``SIGALRM`` handler and any
    pending ``ITIMER_REAL`` (less the time spent here) are restored afterwards.
    """
    armed = [True]

    def _on_alarm(signum, frame):
        if armed[0]:
            raise DeadlineExceeded

    started = time.monotonic()
    previous_handler = signal.getsignal(signal.SIGALRM)
    signal.signal(signal.SIGALRM, _on_alarm)
    try:
        previous_delay, previous_interval = signal.setitimer(
            signal.ITIMER_REAL, min(max(timeout_s, 1e-3), 1e6), _ALARM_REPEAT_S
        )
    except BaseException:
        signal.signal(signal.SIGALRM, previous_handler if previous_handler is not None else signal.SIG_DFL)
        raise

    def _restore() -> None:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler if previous_handler is not None else signal.SIG_DFL)
        if previous_delay > 0:
            remaining = previous_delay - (time.monotonic() - started)
            signal.setitimer(signal.ITIMER_REAL, max(remaining, 1e-4), previous_interval)

    try:
        try:
            return Outcome("ok", fn(*args))
        except DeadlineExceeded:
            return Outcome("timeout")
        except Exception as exc:
            return Outcome("error", detail=type(exc).__name__)
        finally:
            _restore()
    except DeadlineExceeded:
        _restore()
        return Outcome("timeout")


def call_in_daemon_thread(fn: Callable[..., Any], timeout_s: float, *args: Any) -> Outcome:
    """Soft bound: the caller gets an answer in time, but a stuck call keeps its thread."""
    box: list[Outcome] = []

    def _run() -> None:
        try:
            box.append(Outcome("ok", fn(*args)))
        except Exception as exc:
            box.append(Outcome("error", detail=type(exc).__name__))

    worker = threading.Thread(target=_run, name="bounded-call", daemon=True)
    worker.start()
    worker.join(timeout_s)
    return box[0] if box else Outcome("timeout")


class _WorkerProcess:
    """One ``python timeouts.py <module>`` child speaking JSON lines over its stdin/stdout."""

    def __init__(self, module_path: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-u", os.path.abspath(__file__), module_path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            bufsize=0,
            close_fds=True,
            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        )
        self._buffer = b""
        self.ready = False

    def _read_line(self, deadline: float) -> bytes | None:
        """Next line from the child, None at the deadline; EOFError if the child is gone."""
        fd = self.proc.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if not poller.poll(remaining * 1000.0):
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise EOFError
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def wait_ready(self) -> bool:
        if not self.ready:
            line = self._read_line(time.monotonic() + WORKER_START_TIMEOUT_S)
            self.ready = line == b"ready"
        return self.ready

    def request(self, fn_name: str, args: list, timeout_s: float) -> Outcome | None:
        """Outcome of one call; None when the child must be discarded (silent or dead)."""
        payload = json.dumps({"fn": fn_name, "args": args, "timeout": timeout_s}).encode("ascii") + b"\n"
        view = memoryview(payload)
        while view:
            written = os.write(self.proc.stdin.fileno(), view)
            view = view[written:]
        line = self._read_line(time.monotonic() + timeout_s + KILL_GRACE_S)
        if line is None:
            return None
        reply = json.loads(line)
        return Outcome(reply["status"], reply.get("value"), reply.get("detail", ""))

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait(timeout=5)
        except Exception:
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except Exception:
                pass


class WorkerPool:
    """At most ``size`` worker processes for one target module; idle ones are reused."""

    def __init__(self, module_path: str, size: int):
        self.module_path = module_path
        self.size = size
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        self._idle: list[_WorkerProcess] = []
        self._closed = False
        self.start_failures = 0

    @property
    def usable(self) -> bool:
        """False once workers have repeatedly failed to start (e.g. a sandbox forbids it)."""
        return self.start_failures < MAX_START_FAILURES

    def _checkout(self) -> _WorkerProcess:
        with self._lock:
            while self._idle:
                worker = self._idle.pop()
                if worker.proc.poll() is None:
                    return worker
                worker.kill()
        return _WorkerProcess(self.module_path)

    def _checkin(self, worker: _WorkerProcess) -> None:
        with self._lock:
            if self._closed or len(self._idle) >= self.size:
                worker.kill()
            else:
                self._idle.append(worker)

    def call(self, fn_name: str, args: list, timeout_s: float) -> Outcome:
        with self._slots:
            try:
                worker = self._checkout()
            except OSError as exc:
                self.start_failures += 1
                return Outcome("error", detail=f"spawn:{type(exc).__name__}")
            try:
                ready = worker.wait_ready()
            except (EOFError, OSError):
                ready = False
            if not ready:
                worker.kill()
                self.start_failures += 1
                return Outcome("error", detail="worker_start")
            self.start_failures = 0
            try:
                outcome = worker.request(fn_name, args, timeout_s)
            except (EOFError, OSError, ValueError, KeyError):
                worker.kill()
                return Outcome("error", detail="worker_crash")
            if outcome is None:
                worker.kill()
                self._spare()
                return Outcome("timeout")
            self._checkin(worker)
            return outcome

    def _spare(self) -> None:
        """Start a replacement right away so the next caller does not pay the start-up."""
        try:
            self._checkin(_WorkerProcess(self.module_path))
        except OSError:
            pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()


_pools: dict[str, WorkerPool] = {}
_pools_lock = threading.Lock()
_pools_pid = os.getpid()


def default_pool_size() -> int:
    env = os.environ.get("HACPO_REWARD_WORKERS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, min(4, os.cpu_count() or 1))


def get_pool(module_path: str) -> WorkerPool:
    global _pools_pid
    with _pools_lock:
        if os.getpid() != _pools_pid:
            _pools.clear()
            _pools_pid = os.getpid()
        pool = _pools.get(module_path)
        if pool is None:
            pool = _pools[module_path] = WorkerPool(module_path, default_pool_size())
        return pool


def close_pools() -> None:
    with _pools_lock:
        pools = list(_pools.values()) if os.getpid() == _pools_pid else []
        _pools.clear()
    for pool in pools:
        pool.close()


atexit.register(close_pools)


def run_bounded(module: ModuleType, fn_name: str, args: list, timeout_s: float, isolation: str = "auto") -> Outcome:
    """``module.fn_name(*args)`` within ``timeout_s`` seconds.

    ``isolation``: ``auto`` (alarm on the main thread, worker process elsewhere), ``process``
    (always a worker process), ``thread`` (soft bound in a daemon thread), ``inline`` (no bound).
    If worker processes cannot be started the call falls back to ``thread``.
    """
    if isolation not in ISOLATION_MODES:
        raise ValueError(f"isolation={isolation!r}: must be one of {', '.join(ISOLATION_MODES)}")
    fn = getattr(module, fn_name)
    if isolation == "inline":
        try:
            return Outcome("ok", fn(*args))
        except Exception as exc:
            return Outcome("error", detail=type(exc).__name__)
    if isolation == "auto" and on_main_thread():
        return call_with_alarm(fn, timeout_s, *args)
    if isolation in ("auto", "process"):
        pool = get_pool(os.path.abspath(module.__file__))
        if pool.usable:
            outcome = pool.call(fn_name, list(args), timeout_s)
            if not (outcome.status == "error" and outcome.detail.startswith(("spawn", "worker_start"))):
                return outcome
    return call_in_daemon_thread(fn, timeout_s, *args)


def _limit_memory() -> None:
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_LIMIT_BYTES, WORKER_MEMORY_LIMIT_BYTES))
    except Exception:
        pass


def _serve(module_path: str) -> None:
    """Worker process main loop: one JSON request per stdin line, one JSON reply per line."""
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)
    protocol = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _limit_memory()

    spec = importlib.util.spec_from_file_location("_bounded_target", module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    warmup = getattr(module, "warmup", None)
    if callable(warmup):
        call_with_alarm(warmup, WORKER_START_TIMEOUT_S)
    protocol.write(b"ready\n")

    for raw in sys.stdin.buffer:
        try:
            request = json.loads(raw)
            fn = getattr(module, request["fn"])
            outcome = call_with_alarm(fn, float(request["timeout"]), *request["args"])
            reply = {"status": outcome.status, "value": outcome.value, "detail": outcome.detail}
            line = json.dumps(reply)
        except Exception as exc:
            line = json.dumps({"status": "error", "value": None, "detail": type(exc).__name__})
        protocol.write(line.encode("ascii") + b"\n")


if __name__ == "__main__":
    _serve(sys.argv[1])
