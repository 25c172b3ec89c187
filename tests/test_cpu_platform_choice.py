"""The CPU platform is chosen only where asked for: `VERL_PLATFORM`, `HACPO_CPU_PLATFORM`, or a
host without any GPU. A GPU node's process that cannot see its GPU (a CPU-only Ray actor, a CPU
torch build, no nvidia-smi on PATH) keeps verl's CUDA platform; `python -m recipe_hacpo.main`
tells its Ray workers which one from trainer.device. No Ray here."""

from __future__ import annotations

import pytest
import verl  # noqa: F401  (verl's plugins register the platform now, on this host as it is: the
# tests below pretend to be other hosts, and a first `import verl` inside one of them would leave
# this test process without the CPU platform for every later test)
from omegaconf import OmegaConf

from recipe_hacpo.main import platform_env
from recipe_hacpo.workers import cpu_platform


@pytest.fixture
def host(monkeypatch):
    """host(torch_sees_gpu, gpu_driver): a simulated machine, with neither env var set."""
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    monkeypatch.delenv("HACPO_CPU_PLATFORM", raising=False)

    def make(torch_sees_gpu: bool, gpu_driver: bool) -> None:
        monkeypatch.setattr(cpu_platform, "_accelerator_present", lambda: torch_sees_gpu)
        monkeypatch.setattr(cpu_platform, "_gpu_driver_present", lambda: gpu_driver)

    return make


def test_host_without_any_gpu_picks_cpu(host):
    host(torch_sees_gpu=False, gpu_driver=False)
    assert cpu_platform.wants_cpu_platform()


def test_gpu_node_whose_process_cannot_see_the_gpu_does_not(host):
    host(torch_sees_gpu=False, gpu_driver=True)  # e.g. CUDA_VISIBLE_DEVICES="" in a CPU-only actor
    assert not cpu_platform.wants_cpu_platform()


def test_gpu_visible_does_not(host):
    host(torch_sees_gpu=True, gpu_driver=True)
    assert not cpu_platform.wants_cpu_platform()


@pytest.mark.parametrize("value, wanted", [("1", True), ("true", True), ("0", False), ("", False)])
def test_hacpo_cpu_platform_asks_on_a_gpu_node(host, monkeypatch, value, wanted):
    host(torch_sees_gpu=False, gpu_driver=True)
    monkeypatch.setenv("HACPO_CPU_PLATFORM", value)
    assert cpu_platform.wants_cpu_platform() is wanted


@pytest.mark.parametrize("value, wanted", [("cpu", True), ("cuda", False)])
def test_verl_platform_wins(host, monkeypatch, value, wanted):
    host(torch_sees_gpu=False, gpu_driver=False)
    monkeypatch.setenv("HACPO_CPU_PLATFORM", "1" if not wanted else "0")
    monkeypatch.setenv("VERL_PLATFORM", value)
    assert cpu_platform.wants_cpu_platform() is wanted


def test_register_if_wanted_registers_nothing_on_a_gpu_node(host, monkeypatch):
    from verl.plugin.platform import PlatformRegistry

    host(torch_sees_gpu=False, gpu_driver=True)
    calls = []
    monkeypatch.setattr(PlatformRegistry, "register", classmethod(lambda cls, **kw: calls.append(kw) or (lambda c: c)))
    assert cpu_platform.register_if_wanted() is False
    assert calls == []


def test_driver_file_probe_reads_the_real_paths(monkeypatch):
    seen = []
    monkeypatch.setattr(cpu_platform.os.path, "exists", lambda p: seen.append(p) or p == "/dev/nvidiactl")
    assert cpu_platform._gpu_driver_present()
    assert "/proc/driver/nvidia/version" in seen


@pytest.mark.parametrize("device, value", [("cpu", "1"), ("cuda", "0")])
def test_main_tells_ray_workers_from_trainer_device(device, value):
    assert platform_env(OmegaConf.create({"trainer": {"device": device}})) == {"HACPO_CPU_PLATFORM": value}
