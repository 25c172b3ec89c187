"""tests/helpers/built_once.py: two xdist workers asking at once get one build between them, and a
build that raised leaves the next asker to build again."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers.built_once import built_once, shared_root


def _factory(base: Path) -> SimpleNamespace:
    return SimpleNamespace(getbasetemp=lambda: base)


def _slow_build(folder: Path) -> dict:
    # every build leaves a mark in the shared root; the sleep keeps the other worker waiting
    with open(folder.parent / "builds.log", "a") as f:
        f.write(f"{os.getpid()}\n")
    (folder / "weights.bin").write_bytes(b"\x01\x02")
    import time

    time.sleep(0.5)
    return {"path": str(folder / "weights.bin"), "step": {1: 0.25}}


def _worker(base: str, worker: str, results) -> None:
    os.environ["PYTEST_XDIST_WORKER"] = worker
    results.put(built_once(_factory(Path(base) / f"popen-{worker}"), "agents", _slow_build))


def test_two_workers_asking_at_once_share_one_build(tmp_path):
    for worker in ("gw0", "gw1"):
        (tmp_path / f"popen-{worker}").mkdir()
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), w, results)) for w in ("gw0", "gw1")]
    for p in procs:
        p.start()
    got = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len((tmp_path / "builds.log").read_text().split()) == 1
    assert got[0] == got[1] == {"path": str(tmp_path / "agents" / "weights.bin"), "step": {1: 0.25}}
    assert Path(got[0]["path"]).read_bytes() == b"\x01\x02"


def test_without_xdist_the_process_temp_dir_is_the_root(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert shared_root(_factory(tmp_path)) == tmp_path
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    assert shared_root(_factory(tmp_path / "popen-gw1")) == tmp_path


def test_a_build_that_raised_is_built_again_from_an_empty_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)

    def broken(folder: Path):
        (folder / "half.bin").write_bytes(b"\x00")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        built_once(_factory(tmp_path), "agents", broken)
    assert not (tmp_path / "agents.pkl").exists()

    def build(folder: Path) -> list[str]:
        return sorted(os.listdir(folder))

    assert built_once(_factory(tmp_path), "agents", build) == []
    # the second asker loads the first one's result instead of building
    assert built_once(_factory(tmp_path), "agents", lambda folder: pytest.fail("built twice")) == []
