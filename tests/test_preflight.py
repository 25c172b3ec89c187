"""`python -m recipe_hacpo.preflight` on a CPU machine: the parts that can run here run (versions,
the bf16-vs-fp32 loss check on the device at hand, the presets' config checks) and pass; every GPU
part says "skipped: no GPU", never "passed". The install check's verdicts by simulated inputs."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from helpers.e2e import REPO
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
    """The CLI as CI runs it (the train phase, which starts Ray, is its own test below): the CPU
    stand-ins of the weight bucket (shared memory) and of NCCL (gloo) pass with what they moved."""
    if preflight._cuda():
        pytest.skip("this test is the CPU run")
    out = tmp_path / "verdicts.json"
    proc = subprocess.run([sys.executable, "-m", "recipe_hacpo.preflight", "--json", str(out), "--skip", "train"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import json

    verdicts = {v["phase"]: v for v in json.loads(out.read_text())}
    assert verdicts["loss"]["status"] == "passed" and "on cpu" in verdicts["loss"]["detail"]
    assert verdicts["config"]["status"] == "passed"
    for phase in ("install",):
        assert (verdicts[phase]["status"], verdicts[phase]["detail"]) == ("skipped", "no GPU")
    ipc = verdicts["ipc"]
    assert ipc["status"] == "passed", ipc
    assert ipc["detail"].startswith("(CPU stand-in: shared memory) verl's bucket sender/receiver over shared memory")
    # the receivers counted these: 7 tensors in 4 buckets of 1 MiB per agent, compared bit for bit
    assert "7 tensors each in 4 1 MiB buckets, bit-equal, none crossed" in ipc["detail"]
    assert "above-bucket direct send: skipped: no GPU" in ipc["detail"]
    nccl = verdicts["nccl"]
    assert nccl["status"] == "passed" and nccl["detail"].startswith("(CPU stand-in: gloo) "), nccl
    assert "2 ranks each, backend gloo" in nccl["detail"]
    assert (verdicts["train"]["status"], verdicts["train"]["detail"]) == ("skipped", "left out (--skip)")
    assert verdicts["vllm"]["status"] == "skipped" and verdicts["vllm"]["detail"].startswith("no GPU")
    assert all(v["gpu_peak_gib"] is None for v in verdicts.values())  # no GPU, no GPU peak
    assert "Traceback" not in proc.stdout + proc.stderr
    assert len(proc.stdout.strip().splitlines()) == len(verdicts) <= 25  # one screen


@pytest.mark.ray
@pytest.mark.e2e
def test_train_phase_two_agents_step_checkpoint_resume_on_cpu(tmp_path):
    """The train phase's CPU stand-in: the demo's two warm-started agents on one shared pool in bf16,
    step 1 with a checkpoint, then a second run that resumes from it and trains step 2; every
    agent's update has a gradient."""
    if preflight._cuda():
        pytest.skip("this test is the CPU run")
    r = preflight.train_check(str(tmp_path), cuda=False, data_dir=preflight.repo_data_dir())
    assert r["problems"] == [], (r["problems"], r["runs"])
    a, b = r["runs"]["A"]["steps"], r["runs"]["B"]["steps"]
    assert sorted(a) == [1] and sorted(b) == [2]  # B started at step 2: it resumed
    for agent in ("qwen_char", "llama_pair"):
        assert math.isfinite(a[1][f"agent/{agent}/actor/pg_loss"]) and math.isfinite(b[2][f"agent/{agent}/actor/pg_loss"])
        assert max(a[1][f"agent/{agent}/actor/grad_norm"], b[2][f"agent/{agent}/actor/grad_norm"]) > 0
        assert a[1][f"agent/{agent}/reward/mean"] > 0 or b[2][f"agent/{agent}/reward/mean"] > 0
        for step in (1, 2):
            assert os.listdir(tmp_path / "ckpt" / f"global_step_{step}" / agent / "actor")
    assert r["peak"] is None


def test_judge_train_finds_what_a_broken_run_leaves(tmp_path):
    """A run B that started over (no resume), a NaN loss, a checkpoint without an agent: each named."""
    from recipe_hacpo.cluster.reliability import STATE_FILE

    agents = ["qwen_char", "llama_pair"]
    ok = {f"agent/{a}/actor/{k}": 0.1 for a in agents for k in ("pg_loss", "grad_norm")}
    for step in (1, 2):
        for agent in agents:
            os.makedirs(tmp_path / f"global_step_{step}" / agent / "actor")
            (tmp_path / f"global_step_{step}" / agent / "actor" / "model.pt").write_bytes(b"x")
        (tmp_path / f"global_step_{step}" / STATE_FILE).write_bytes(b"x")
    assert preflight.judge_train({1: ok}, {2: ok}, str(tmp_path), agents) == []
    problems = preflight.judge_train({1: ok}, {1: ok, 2: ok}, str(tmp_path), agents)
    assert problems == ["run B logged steps [1, 2], expected [2] (a resume from global_step_1)"]
    nan = ok | {"agent/llama_pair/actor/pg_loss": float("nan")}
    problems = preflight.judge_train({1: ok}, {2: nan}, str(tmp_path), agents)
    assert problems == ["run B step 2: llama_pair pg_loss nan"]
    nan_grad = ok | {"agent/qwen_char/actor/grad_norm": float("nan")}
    assert preflight.judge_train({1: nan_grad}, {2: ok}, str(tmp_path), agents) == [
        "run A step 1: qwen_char grad_norm nan"]
    # untrained agents: reward 0 everywhere, every advantage and so every gradient exactly 0
    still = ok | {"agent/llama_pair/actor/grad_norm": 0.0}
    assert preflight.judge_train({1: still}, {2: still | {"agent/qwen_char/actor/grad_norm": 0.0}}, str(tmp_path),
                                 agents) == ["llama_pair: grad_norm 0 at every step (every advantage 0: no update "
                                             "changed a weight)"]
    assert preflight.judge_train({1: still}, {2: ok}, str(tmp_path), agents) == []
    import shutil

    shutil.rmtree(tmp_path / "global_step_2" / "llama_pair")
    problems = preflight.judge_train({1: ok}, {2: ok}, str(tmp_path), agents)
    assert len(problems) == 1 and "llama_pair" in problems[0] and "global_step_2" in problems[0]


def test_compare_received_names_missing_foreign_and_unequal_tensors():
    import torch

    sent = preflight.ipc_weights(0, "qwen_char", cuda=False)
    got = {n: t.clone() for n, t in sent}
    assert preflight.compare_received(sent, got, "qwen_char") == {"received": 7, "missing": [], "foreign": [], "unequal": []}
    names = [n for n, _ in sent]
    got[names[0]] = got[names[0]].float()  # same values, another dtype
    flipped = got[names[2]].clone()
    flipped.view(torch.int32)[0, 0] ^= 1  # one bit of one fp32 value
    got[names[2]] = flipped
    del got[names[3]]
    got["llama_pair.lm_head.weight"] = torch.zeros(1)
    r = preflight.compare_received(sent, got, "qwen_char")
    assert r["missing"] == [names[3]] and r["foreign"] == ["llama_pair.lm_head.weight"]
    assert r["unequal"] == sorted([names[0], names[2]])


def test_ipc_socket_names_are_per_agent():
    handles = preflight.ipc_socket_names("0a1b2c3d")
    assert handles == {"qwen_char": "ipc:///tmp/rl-colocate-zmq-0a1b2c3d-qwen_char-replica-0-rank-0.sock",
                       "llama_pair": "ipc:///tmp/rl-colocate-zmq-0a1b2c3d-llama_pair-replica-0-rank-0.sock"}


def test_group_values_tell_the_agents_apart():
    values = {preflight.group_value(a, r) for a in range(2) for r in range(2)}
    assert len(values) == 4
    assert {sum(preflight.group_value(a, r) for r in range(2)) for a in range(2)} == {201.0, 401.0}


def test_missing_packages_are_one_skipped_line(monkeypatch):
    """A GPU node without Ray, verl or vLLM: each phase that needs one says so, nothing raises."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] in ("verl", "ray", "zmq") else real(name, *a))
    assert preflight.phase_ipc() == preflight.Verdict("ipc", "skipped", "verl not installed")
    assert preflight.phase_train() == preflight.Verdict("train", "skipped", "verl not installed")
    r = preflight.loss_check("cpu")
    assert r["gspo_equal"] is None and r["loss_abs_diff"] == 0.0


def test_a_cpu_torch_on_a_machine_with_an_nvidia_gpu_is_refused_in_one_line(monkeypatch, capsys):
    """`make preflight` from the CPU environment on a GPU node: every GPU check would pass on its CPU
    stand-in; refused before any phase, naming this Python and how to get the GPU one."""
    import torch

    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(preflight, "nvidia_gpu_seen", lambda: "/dev/nvidia0")
    monkeypatch.setattr(preflight, "phase_versions", lambda: pytest.fail("a phase ran after the refusal"))
    assert preflight.main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {sys.executable} has torch ")
    assert "(/dev/nvidia0)" in err and "make venv-gpu" in err and "PREFLIGHT_PY=" in err
    # a CUDA torch there, and a CPU torch where no NVIDIA GPU shows, are not refused
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert preflight.cpu_python_refusal() is None
    monkeypatch.setattr(torch.version, "cuda", None)
    assert preflight.cpu_python_refusal(gpu_seen=lambda: None) is None


def test_the_gpu_probe_reads_device_files_and_nvidia_smi(monkeypatch, tmp_path):
    import shutil

    monkeypatch.setattr(preflight, "NVIDIA_DEVICE_FILES", (str(tmp_path / "nvidia0"), str(tmp_path / "nvidia")))
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert preflight.nvidia_gpu_seen() is None
    (tmp_path / "nvidia").mkdir()
    assert preflight.nvidia_gpu_seen() == str(tmp_path / "nvidia")
    (tmp_path / "nvidia").rmdir()
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/nvidia-smi" if name == "nvidia-smi" else None)
    assert preflight.nvidia_gpu_seen() == "/usr/bin/nvidia-smi"


def test_run_phase_turns_exceptions_into_one_line():
    def phase_vllm():
        raise ModuleNotFoundError("No module named 'vllm'", name="vllm")

    def phase_train():
        raise ModuleNotFoundError("No module named 'recipe_hacpo.nothing'", name="recipe_hacpo.nothing")

    def phase_nccl():
        raise RuntimeError("NCCL error: unhandled system error\nlast error: ...")

    assert preflight.run_phase(phase_vllm) == preflight.Verdict("vllm", "skipped", "vLLM not installed")
    assert preflight.run_phase(phase_train).status == "failed"
    assert preflight.run_phase(phase_nccl) == preflight.Verdict("nccl", "failed",
                                                                "RuntimeError: NCCL error: unhandled system error")


def test_train_overrides_on_a_gpu_give_the_second_agent_offload_policy():
    o = preflight.train_overrides({"a": "/m/a", "b": "/m/b"}, "/w", cuda=True)
    assert "~agents" in o
    agents = next(x for x in o if x.startswith("+agents="))
    assert "{a:{model_path:'/m/a',rollout_n:4,n_gpus_per_node:0" in agents
    assert "fsdp_config:{param_offload:true,optimizer_offload:true}" in agents
    assert "fsdp_config:{offload_policy:true}" in agents
    assert "trainer.device=cuda" in o and "+actor_rollout_ref.rollout.engine_kwargs.hf.device=cuda" in o
    assert "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16" in o
    assert "actor_rollout_ref.rollout.gpu_memory_utilization=0.15" in o  # the memory plan's vLLM share
    cpu = preflight.train_overrides({"a": "/m/a", "b": "/m/b"}, "/w", cuda=False)
    assert "offload_policy" not in next(x for x in cpu if x.startswith("+agents=")) and "trainer.device=cpu" in cpu
    v = preflight.train_overrides({"a": "/m/a", "b": "/m/b"}, "/w", cuda=True, vllm=True)
    assert "actor_rollout_ref.rollout.name=vllm" in v and not any("engine_kwargs.hf" in x for x in v)


def test_loss_check_fails_when_the_loss_accumulates_in_bf16(monkeypatch):
    """Negative control: with the accumulation dtype forced to the input's, the check fails."""
    import recipe_hacpo.methods.core_algos as ca

    monkeypatch.setattr(ca, "to_accumulation_dtype", lambda x: x)
    verdict = preflight.phase_loss()
    assert verdict.status == "failed"


# A GPU node as it comes: torch and transformers, none of verl, Ray, vLLM, pyzmq, hydra, omegaconf
_BARE_NODE = """
import runpy, sys
BLOCKED = {"verl", "ray", "zmq", "vllm", "hydra", "omegaconf", "tensordict"}
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
if __name__ == "__main__":
    sys.meta_path.insert(0, Block())
    sys.argv = ["preflight", *sys.argv[1:]]
    runpy.run_module("recipe_hacpo.preflight", run_name="__main__")
"""


def test_a_node_without_verl_ray_or_vllm_gets_one_line_per_phase(tmp_path):
    script = tmp_path / "bare_node.py"
    script.write_text(_BARE_NODE)
    out = tmp_path / "v.json"
    proc = subprocess.run([sys.executable, str(script), "--json", str(out), "--skip", "nccl"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    import json

    verdicts = {v["phase"]: (v["status"], v["detail"]) for v in json.loads(out.read_text())}
    assert verdicts["loss"][0] == "passed" and "own rows vs verl GSPO: skipped: verl not installed" in verdicts["loss"][1]
    assert verdicts["config"] == ("skipped", "hydra-core not installed")
    assert verdicts["ipc"] == ("skipped", "verl not installed")
    assert verdicts["train"] == ("skipped", "verl not installed")
    assert verdicts["nccl"] == ("skipped", "left out (--skip)")


def _dies_without_a_report(q):
    os._exit(3)


def test_a_child_that_dies_is_one_line_not_a_wait_for_the_timeout():
    import time

    t0 = time.monotonic()
    reports, error = preflight._spawn(_dies_without_a_report, [(), ()], timeout=120)
    assert reports == [] and error == "2 of 2 processes exited without a report (exit codes [3])"
    assert time.monotonic() - t0 < 60


def test_two_agents_on_one_socket_name_fail_before_anything_is_sent(monkeypatch):
    same = "ipc:///tmp/rl-colocate-zmq-x-replica-0-rank-0.sock"
    monkeypatch.setattr(preflight, "ipc_socket_names", lambda job: {"qwen_char": same, "llama_pair": same})
    v = preflight.phase_ipc()
    assert v.status == "failed" and "two agents share one socket name" in v.detail


def test_a_training_run_past_its_limit_is_stopped_and_one_line(tmp_path):
    import time

    t0 = time.monotonic()
    run = preflight.run_main(["--config-name", "hacpo_cpu_demo"], str(tmp_path), "A", timeout=1)
    assert run["rc"] == "timeout" and run["steps"] == {}
    assert run["why"].startswith("run A timed out: ") and "\n" not in run["why"]
    assert time.monotonic() - t0 < 45


def test_train_agents_are_the_shipped_warm_starts_by_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    dirs = preflight.train_agent_dirs("data")
    assert dirs is not None and set(dirs) == {"qwen_char", "llama_pair"}
    assert all(os.path.isabs(d) and os.path.isfile(os.path.join(d, "config.json")) for d in dirs.values())
    assert preflight.train_agent_dirs(str(tmp_path)) is None  # no demo agents there: the phase says skipped
