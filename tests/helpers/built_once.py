"""Session fixtures built once per test run, even when pytest-xdist runs the tests on several
workers: the first worker to ask builds the thing into the run's shared temp root, under a file
lock; the others wait on the lock and load what it built.

Without xdist the run has one process and this is a plain session fixture's body. Only
deterministic builds belong here (seeded warm starts, seeded reference runs): every worker must get
what it would have built itself.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import shutil
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")


def shared_root(tmp_path_factory) -> Path:
    """The temp root every process of this test run sees: the run's own temp dir, which holds
    one folder per xdist worker (`popen-gw0`, ...), or the process's own without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory, name: str, build: Callable[[Path], T]) -> T:
    """`build(folder)`'s result, computed by one process of the run and shared by the rest.

    `build` writes whatever it makes under `folder` (an empty folder `<root>/<name>`) and returns
    a picklable value (paths under `folder`, metrics). A build that raised leaves nothing behind:
    the next worker to ask builds again, and gets the error itself.
    """
    root = shared_root(tmp_path_factory)
    folder = root / name
    result = root / f"{name}.pkl"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if result.exists():
            return pickle.loads(result.read_bytes())
        shutil.rmtree(folder, ignore_errors=True)  # a build that failed midway
        folder.mkdir()
        value = build(folder)
        staged = root / f"{name}.pkl.tmp"
        staged.write_bytes(pickle.dumps(value))
        os.replace(staged, result)
        return value
