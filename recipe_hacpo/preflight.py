"""`python -m recipe_hacpo.preflight [--check-install] [--json FILE]`: what to run first on a GPU node.

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
  gpu_*      CUDA IPC weight bucket, NCCL groups, two tiny agents training on one GPU, vLLM
             servers: not part of this version; reported as not run
"""

from __future__ import annotations

import argparse
import glob
import importlib
import importlib.metadata as md
import json
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
    for module, fix in (("flash_attn", "pip install --no-build-isolation -e '.[flash-attn]' (or attn_implementation=sdpa)"),
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

    from recipe_hacpo.core_algos import hacpo_policy_loss_matrix, seq_mean_token_mean

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
    ok = r["loss_abs_diff"] == 0.0 and r["grad_rel_diff"] < 1e-2 and r["gspo_equal"]
    detail = (f"on {device}: bf16 vs fp32 loss diff {r['loss_abs_diff']:.3g}, grad rel diff {r['grad_rel_diff']:.2e}; "
              f"own rows {'==' if r['gspo_equal'] else '!='} verl GSPO (fp32, bit for bit)")
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


def gpu_phases() -> list[Verdict]:
    names = ("gpu_ipc", "gpu_nccl", "gpu_train", "gpu_vllm")
    if not _cuda():
        return [Verdict(n, "skipped", "no GPU") for n in names]
    return [Verdict(n, "skipped", "not part of this version of the preflight") for n in names]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m recipe_hacpo.preflight", description=__doc__.splitlines()[0])
    ap.add_argument("--check-install", action="store_true", help="versions and the GPU install only")
    ap.add_argument("--json", help="also write the verdicts to this file")
    args = ap.parse_args(argv)
    phases = [phase_versions, phase_install]
    if not args.check_install:
        phases += [phase_loss, phase_config]
    verdicts = []
    for phase in phases:
        try:
            verdicts.append(phase())
        except Exception as exc:  # one phase's crash is its verdict, the others still run
            verdicts.append(Verdict(phase.__name__.removeprefix("phase_"), "failed", _first_line(exc)))
    if not args.check_install:
        verdicts += gpu_phases()
    for v in verdicts:
        print(v.line())
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(v) for v in verdicts], f, indent=1)
    return 1 if any(v.status == "failed" for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
