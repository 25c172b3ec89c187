"""Entry point of the `verl.plugins` group: verl imports it on `import verl` in every process.

That includes the driver, the TaskRunner and every Ray worker, which is what makes the
registrations below visible wherever verl builds a platform or a rollout. The HACPO loss
needs no registry entry: `workers/hacpo_worker.py` installs it on the actor it trains.

What is registered:

- the CPU platform (`workers/cpu_platform.py`), only when this process wants it: when
  `VERL_PLATFORM=cpu` or `HACPO_CPU_PLATFORM=1` (set for the Ray workers of a
  trainer.device=cpu run), or, with neither set, on a host without any GPU (no accelerator
  visible to torch and no GPU kernel driver). On GPU/NPU hosts nothing changes.
  `HACPO_CPU_PLATFORM=0` opts out entirely.
- the `hf` rollout backend (`workers/hf_cpu_rollout/hf_rollout.py` via `workers/verl_touchpoints.py`),
  always: it is inert unless `actor_rollout_ref.rollout.name=hf`.
- verl's `vllm` rollout name resolved to `workers/vllm_rollout.py` (verl's vLLM rollout with
  per-agent server and weight-socket names, needed when several agents share a Ray job;
  identical to verl's when no agent name is set), always, lazily: nothing from vLLM is
  imported unless a `vllm` rollout is built.

verl runs this module at the very end of `verl/__init__.py` and swallows plugin exceptions
at DEBUG level, so failures are logged here as warnings instead of vanishing.
"""

from __future__ import annotations

import logging
import os

import recipe_hacpo.quiet  # noqa: F401,E402  (silences known third-party messages; HACPO_VERBOSE=1 keeps them)

logger = logging.getLogger(__name__)

_OPT_OUT = {"0", "false", "off", "no"}


def _register_cpu_platform() -> None:
    if os.environ.get("HACPO_CPU_PLATFORM", "1").strip().lower() in _OPT_OUT:
        return
    # Cheap: verl.plugin.platform is already imported by verl.utils.device at this point.
    from recipe_hacpo.workers.cpu_platform import register_if_wanted
    from recipe_hacpo.workers.verl_touchpoints import install_backend_string_dedup, register_cpu_engines

    if register_if_wanted():
        # verl asks torch for "cpu:gloo,<device>:<backend>" = "cpu:gloo,cpu:gloo" on CPU.
        install_backend_string_dedup()
        # verl's FSDP engines are registered for cuda/npu only.
        register_cpu_engines()


def _register_rollout_backends() -> None:
    from recipe_hacpo.workers.verl_touchpoints import register_hacpo_vllm_rollout, register_hf_rollout

    register_hf_rollout()
    register_hacpo_vllm_rollout()


for _step in (_register_cpu_platform, _register_rollout_backends):
    try:
        _step()
    except Exception:
        logger.warning("recipe_hacpo plugin: %s failed", _step.__name__, exc_info=True)
