"""`python -m recipe_hacpo.preflight` on a CPU machine: the parts that can run here run (versions,
the bf16-vs-fp32 loss check on the device at hand, the presets' config checks) and pass; every GPU
part says "skipped: no GPU", never "passed". The install check's verdicts by simulated inputs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from recipe_hacpo import preflight


def _imports_ok(name):
    return None


def test_install_problems_cuda12_torch_and_old_driver():
    problems = preflight.install_problems(torch_cuda="12.8", driver="570.86.15", vllm_installed=True,
                                          import_module=_imports_ok, vllm_dir="/nonexistent")
    assert problems[0].startswith("torch is a CUDA 12.8 build but vLLM 0.24.0 needs CUDA 13")
    assert preflight.TORCH_INDEX_URL in problems[0]
    assert problems[1].startswith("NVIDIA driver 570.86.15 is older than R580")


def test_install_problems_none_on_a_good_install(tmp_path):
    (tmp_path / "_C_stable_libtorch.abi3.so").write_text("")
    seen = []
    problems = preflight.install_problems(torch_cuda="13.0", driver="580.65.06", vllm_installed=True,
                                          import_module=seen.append, vllm_dir=str(tmp_path))
    assert problems == []
    assert "vllm._C_stable_libtorch" in seen and "flash_attn" in seen  # the kernels were loaded


def test_install_problems_kernel_that_does_not_load(tmp_path):
    (tmp_path / "_vllm_fa3_C.abi3.so").write_text("")

    def load(name):
        if name == "vllm._vllm_fa3_C":
            raise ImportError("libcudart.so.13: cannot open shared object file: No such file or directory")

    problems = preflight.install_problems(torch_cuda="13.0", driver="580.65.06", vllm_installed=True,
                                          import_module=load, vllm_dir=str(tmp_path))
    assert problems == ["vLLM's compiled kernels vllm._vllm_fa3_C do not load: ImportError: libcudart.so.13: "
                        "cannot open shared object file: No such file or directory"]


def test_cpu_run_passes_what_runs_here_and_skips_the_gpu_parts(tmp_path):
    if preflight._cuda():
        pytest.skip("this test is the CPU run")
    out = tmp_path / "verdicts.json"
    proc = subprocess.run([sys.executable, "-m", "recipe_hacpo.preflight", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import json

    verdicts = {v["phase"]: v for v in json.loads(out.read_text())}
    assert verdicts["loss"]["status"] == "passed" and "on cpu" in verdicts["loss"]["detail"]
    assert verdicts["config"]["status"] == "passed"
    for phase in ("install", "gpu_ipc", "gpu_nccl", "gpu_train", "gpu_vllm"):
        assert (verdicts[phase]["status"], verdicts[phase]["detail"]) == ("skipped", "no GPU")
    assert len(proc.stdout.strip().splitlines()) == len(verdicts) <= 25  # one screen


def test_loss_check_fails_when_the_loss_accumulates_in_bf16(monkeypatch):
    """Negative control: with the accumulation dtype forced to the input's, the check fails."""
    import recipe_hacpo.core_algos as ca

    monkeypatch.setattr(ca, "to_accumulation_dtype", lambda x: x)
    verdict = preflight.phase_loss()
    assert verdict.status == "failed"
