"""Atomic publication of files and directories: readers see the old version or the new one, never a torn one.

A file or directory is written under a temporary name in the destination's own directory (same
filesystem, so the rename is atomic) and renamed over the destination with `os.replace`. The
parent directory is fsynced after the rename so the new name survives a power loss, not only a
killed process.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from typing import Iterator


def fsync_dir(path: str) -> None:
    """Make a rename inside `path` durable (no-op where directories cannot be opened or synced)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems (and Windows) refuse fsync on a directory
    finally:
        os.close(fd)


def atomic_write_text(path: str, text: str) -> None:
    """Replace `path` with `text`, flushed to disk before the rename."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_write_json(path: str, data, indent: int | None = 2) -> None:
    """`atomic_write_text` of `data` as JSON."""
    atomic_write_text(path, json.dumps(data, indent=indent))


def replace_dir(staged: str, path: str) -> None:
    """Publish the finished directory `staged` as `path`, removing an older `path` first.

    Between the removal and the rename `path` is absent; readers that must never see that
    (checkpoint resume) look for the newest complete sibling instead.
    """
    if os.path.exists(path):
        shutil.rmtree(path)
    os.replace(staged, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


@contextmanager
def staging_dir(parent: str, prefix: str) -> Iterator[str]:
    """A fresh hidden directory in `parent`, removed if the block raises (or was not published)."""
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op once replace_dir moved it
