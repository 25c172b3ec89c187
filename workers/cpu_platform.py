"""A CPU device platform for verl's platform registry.

verl 0.9.1 ships CUDA, NPU and ROCm platforms only; on a machine without an accelerator it
falls back to CUDA and every `torch.cuda` call fails. This platform lets the FSDP2 engine,
the rollout workers and the trainer run on CPU with gloo.

Two choices are deliberate:

- `ray_resource_name()` is "GPU". verl's `ResourcePoolManager` only builds GPU pools, so on
  CPU Ray is started with *logical* GPUs (`ray.init(num_gpus=N)`) and each FSDP rank holds
  one. Nothing ever touches a physical device: Ray only uses the count for scheduling.
- `current_device()` returns "cpu", not an index: verl moves tensors with
  `.to(get_device_id())` and `torch.device(get_device_id())`, which need a device string on
  CPU (an int would mean `cuda:<int>`).
"""

from __future__ import annotations

import os
import types
from contextlib import contextmanager
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

PLATFORM_NAME = "cpu"


def _accelerator_present() -> bool:
    """True when torch sees any accelerator that a built-in verl platform would drive."""
    if torch.cuda.is_available():
        return True
    for name in ("npu", "xpu", "mlu"):
        module = getattr(torch, name, None)
        try:
            if module is not None and module.is_available():
                return True
        except Exception:  # a half-installed vendor extension must not break detection
            continue
    return False


def _host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory; what `mem_get_info` means on CPU."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)
    except ImportError:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        avail = os.sysconf("SC_AVPHYS_PAGES")
        return int(avail * page_size), int(pages * page_size)


def _noop(*args, **kwargs) -> None:
    return None


def _zero(*args, **kwargs) -> int:
    return 0


class _CpuDeviceModule(types.ModuleType):
    """`torch.cpu` plus the `torch.cuda`-style calls verl makes on `get_torch_device()`.

    `torch.cpu` lacks empty_cache / memory statistics / RNG state; verl calls them
    unconditionally (memory logging, checkpoint RNG save/restore), so they are answered here:
    memory counters are 0, cache calls do nothing, RNG state is the global CPU generator's.
    """

    def __init__(self) -> None:
        super().__init__("recipe_hacpo_cpu_device")
        self.empty_cache = _noop
        self.ipc_collect = _noop
        self.reset_peak_memory_stats = _noop
        self.set_per_process_memory_fraction = _noop
        self.memory_allocated = _zero
        self.memory_reserved = _zero
        self.max_memory_allocated = _zero
        self.max_memory_reserved = _zero
        self.mem_get_info = lambda *a, **k: _host_memory()
        self.get_rng_state = lambda *a, **k: torch.get_rng_state()
        self.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
        self.manual_seed = torch.manual_seed
        self.manual_seed_all = torch.manual_seed
        self.get_device_name = lambda *a, **k: "cpu"
        self.synchronize = _noop
        self.set_device = _noop

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)


_DEVICE_MODULE = _CpuDeviceModule()


class PlatformCPU(PlatformBase):
    """verl platform for hosts without an accelerator: device "cpu", collectives over gloo."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return _DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Auto-detection probes platforms in registration order and this one registers after
        # verl's built-ins, so it is only reached when none of them claimed the host; still
        # refuse explicitly so a platform registered after us is never shadowed on a GPU box.
        return not _accelerator_present()

    def current_device(self) -> str:  # type: ignore[override]  (see module docstring)
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # Ray exports CUDA_VISIBLE_DEVICES for logical GPUs; reading it is harmless on CPU.
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


# kernel-driver files of a GPU host: present whatever torch, CUDA_VISIBLE_DEVICES or PATH say
_GPU_DRIVER_FILES = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd")
_ASKED = {"1", "true", "on", "yes"}


def _gpu_driver_present() -> bool:
    """True on a host with an NVIDIA or AMD GPU kernel driver loaded."""
    return any(os.path.exists(path) for path in _GPU_DRIVER_FILES)


def wants_cpu_platform() -> bool:
    """Whether this process should run verl on the CPU platform.

    `VERL_PLATFORM` is verl's own override and wins when set; `HACPO_CPU_PLATFORM=1` asks for
    the CPU platform (`python -m recipe_hacpo.main` sets it for its Ray workers when
    trainer.device=cpu, and `HACPO_CPU_PLATFORM=0` otherwise). With neither set, the CPU
    platform is chosen only on a host with no GPU at all: torch sees no accelerator *and* no
    GPU kernel driver is loaded. A process on a GPU node that merely cannot see its GPU (a
    CPU-only Ray actor, a CPU build of torch, no nvidia-smi on PATH) never picks it by accident.
    """
    forced = os.environ.get("VERL_PLATFORM", "").strip().lower()
    if forced:
        return forced == PLATFORM_NAME
    if os.environ.get("HACPO_CPU_PLATFORM", "").strip().lower() in _ASKED:
        return True
    return not _accelerator_present() and not _gpu_driver_present()


def register_if_wanted() -> bool:
    """Register `PlatformCPU` under "cpu" when `wants_cpu_platform()`; returns whether it did.

    Registration alone selects nothing: verl picks the platform on its first `get_platform()`
    call, from `VERL_PLATFORM` or by probing registered platforms in order (this one last).
    """
    if not wants_cpu_platform():
        return False
    if PlatformRegistry.get(PLATFORM_NAME) is not PlatformCPU:
        PlatformRegistry.register(platform=PLATFORM_NAME)(PlatformCPU)
    return True
