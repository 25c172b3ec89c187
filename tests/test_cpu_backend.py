"""verl 0.9.1 on CPU with the `hf` rollout backend.

1. The HF rollout server alone: log-probs equal a forward pass of the same weights, stop
   reasons, greedy determinism, sampling knobs, weight-sync strictness.
2. verl's own `main_ppo` (unmodified, as a subprocess) trains 2 GSPO steps on CPU with
   `rollout.name=hf` through two FSDP2 ranks over gloo: the rollout and actor agree on
   log-probs after every weight sync and the actor's weights move.

`CPU_OVERRIDES` / `ppo_overrides` are the Hydra overrides that make this work; the
multi-agent trainer reuses them.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from recipe_hacpo import tiny_agents
from console_log import parse_console_steps
from helpers.verl_cpu import CPU_OVERRIDES, compose_ppo_config, ray_overrides

TINY_KIND = "qwen2-char-small"

# ---------------------------------------------------------------------------------------
# the overrides (shared with the multi-agent trainer)
# ---------------------------------------------------------------------------------------

"""Backend overrides for verl's ppo_trainer config on a CPU-only host (add `ray_overrides`)."""

GSPO_OVERRIDES: tuple[str, ...] = (
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
    "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
    "actor_rollout_ref.actor.use_kl_loss=False",
)


def ppo_overrides(
    model_path: str,
    train_file: str,
    val_file: str,
    reward_path: str,
    out_dir: str,
    *,
    n_workers: int = 2,
    steps: int = 2,
    batch_size: int = 4,
    n: int = 2,
    prompt_length: int = 32,
    response_length: int = 16,
    reward_name: str = "compute_score",
) -> list[str]:
    """A complete override list for a tiny GSPO run of verl's main_ppo on CPU."""
    return [
        *CPU_OVERRIDES,
        *GSPO_OVERRIDES,
        *ray_overrides(n_workers),
        f"data.train_files={train_file}",
        f"data.val_files={val_file}",
        f"data.train_batch_size={batch_size}",
        f"data.max_prompt_length={prompt_length}",
        f"data.max_response_length={response_length}",
        f"actor_rollout_ref.model.path={model_path}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch_size}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        f"actor_rollout_ref.rollout.n={n}",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
        f"reward.custom_reward_function.path={reward_path}",
        f"reward.custom_reward_function.name={reward_name}",
        f"trainer.total_training_steps={steps}",
        "trainer.total_epochs=1",
        "trainer.logger=[console]",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.project_name=hacpo_cpu_test",
        "trainer.experiment_name=hf_backend",
        f"trainer.default_local_dir={out_dir}/ckpt",
        f"hydra.run.dir={out_dir}/hydra",
    ]


# ---------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model_path(tmp_path_factory) -> str:
    return tiny_agents.build_agent(str(tmp_path_factory.mktemp("cpu_backend_agents")), TINY_KIND)


def _rollout_config(**kw):
    from verl.workers.config import RolloutConfig

    base = dict(
        name="hf",
        tensor_model_parallel_size=1,
        prompt_length=64,
        response_length=24,
        dtype="float32",
        load_format="auto",
        calculate_log_probs=True,
    )
    base.update(kw)
    return RolloutConfig(**base)


def _model_config(path):
    from verl.workers.config import HFModelConfig

    return HFModelConfig(path=path)


def _chat_ids(tokenizer, text: str) -> list[int]:
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _reference_token_scores(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each response token from one plain forward pass."""
    full = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(full).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


# ---------------------------------------------------------------------------------------
# 0. pure pieces (no Ray)
# ---------------------------------------------------------------------------------------


def test_plugin_registered_cpu_platform_and_hf_backend():
    import verl  # noqa: F401  (loads the verl.plugins entry point)
    from recipe_hacpo.workers.hf_cpu_rollout.hf_rollout import HFReplica, HFServerAdapter
    from recipe_hacpo.workers.verl_touchpoints import dedupe_backend_string
    from verl.utils.device import get_device_name, get_nccl_backend, get_resource_name
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    if not torch.cuda.is_available():
        assert (get_device_name(), get_nccl_backend(), get_resource_name()) == ("cpu", "gloo", "GPU")
        assert EngineRegistry.get_engine_cls("language_model", "fsdp2").__name__ == "FSDPEngineWithLMHead"
    assert get_rollout_replica_class("hf") is HFReplica
    assert get_rollout_class("hf") is HFServerAdapter
    assert dedupe_backend_string("cpu:gloo,cpu:gloo") == "cpu:gloo"
    assert dedupe_backend_string("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"
    assert dedupe_backend_string("cpu:gloo,cpu:nccl") == "cpu:gloo,cpu:nccl"  # conflict: left for torch to reject


def test_server_names_are_per_agent():
    from recipe_hacpo.workers.hf_cpu_rollout.hf_rollout import server_actor_name

    solo = _rollout_config()
    alice, bob = _rollout_config(custom={"agent_name": "alice"}), _rollout_config(custom={"agent_name": "bob"})
    assert server_actor_name(solo, 0) == "hf_server_0_0"
    assert server_actor_name(alice, 0) == "hf_alice_server_0_0"
    assert len({server_actor_name(c, r) for c in (solo, alice, bob) for r in (0, 1)}) == 6


def test_parse_sampling_defaults_and_limits():
    from recipe_hacpo.workers.hf_cpu_rollout.hf_sampling import parse_sampling

    cfg = _rollout_config(temperature=0.7, top_k=5, top_p=0.9, max_model_len=80)
    s = parse_sampling({}, cfg, prompt_len=10)
    assert (s.do_sample, s.temperature, s.top_k, s.top_p) == (True, 0.7, 5, 0.9)
    assert s.max_new_tokens == 24  # response_length
    assert parse_sampling({"max_tokens": 500}, cfg, prompt_len=70).max_new_tokens == 10  # room in max_model_len
    greedy = parse_sampling({"temperature": 0, "top_k": -1}, cfg, prompt_len=10)
    assert not greedy.do_sample and greedy.top_k is None
    assert parse_sampling({"top_k": -1}, cfg, prompt_len=10).top_k == 0  # vLLM "off" -> HF "off"
    with pytest.raises(ValueError, match="n=2"):
        parse_sampling({"n": 2}, cfg, prompt_len=10)
    with pytest.raises(ValueError, match="unsupported"):
        parse_sampling({"best_of": 3}, cfg, prompt_len=10)
    with pytest.raises(ValueError, match="no room"):
        parse_sampling({}, cfg, prompt_len=80)


def test_seeded_rows_sample_the_same_alone_or_batched(tiny_model_path, reference):
    """A seeded row's tokens depend on its prompt and seed only, not on its batch mates."""
    from recipe_hacpo.workers.hf_cpu_rollout.hf_engine import HFEngine
    from recipe_hacpo.workers.hf_cpu_rollout.hf_sampling import parse_sampling

    model, tok = reference
    cfg = _rollout_config(max_model_len=128)
    engine = HFEngine(cfg, _model_config(tiny_model_path), seed=0)
    prompts = [_chat_ids(tok, t) for t in ("1+1=", "a much longer prompt than the others", "hi", "1+1=")]
    sampling = parse_sampling({"temperature": 0.7, "top_k": -1, "logprobs": True, "max_tokens": 12}, cfg, 40)
    seeds = [11, 22, 33, 44]
    batched = engine.generate(prompts, sampling, seeds)
    torch.manual_seed(123)  # the global RNG plays no part
    alone = [engine.generate([p], sampling, [s])[0] for p, s in zip(prompts, seeds)]
    for b, a in zip(batched, alone, strict=True):
        assert b.token_ids == a.token_ids
        assert torch.allclose(torch.tensor(b.log_probs), torch.tensor(a.log_probs), atol=1e-5)
    # the same prompt under two seeds is two different samples; the same seed repeats
    assert batched[0].token_ids != batched[3].token_ids
    assert engine.generate([prompts[0]], sampling, [11])[0].token_ids == batched[0].token_ids
    # log-probs are the tempered distribution's, not the perturbed scores
    for prompt, out in zip(prompts, batched):
        expected = _reference_token_scores(model, prompt, out.token_ids, temperature=0.7)
        assert torch.allclose(torch.tensor(out.log_probs), expected, atol=1e-5)


def test_a_recorded_sample_tape_is_replayed_token_for_token_under_other_weights(tiny_model_path, reference, tmp_path):
    """`rollout.custom.record_samples` writes each sampled request's tokens by its seed;
    `replay_samples` makes an engine whose logits differ (here: perturbed weights, as another
    machine's kernels would) generate exactly those tokens, with its own model's log-probs of
    them. A seed the tape lacks, or a generation that runs past its tape line, fails in one line
    naming the agent and the seed; greedy requests are not recorded."""
    from recipe_hacpo.workers.hf_cpu_rollout.hf_engine import HFEngine
    from recipe_hacpo.workers.hf_cpu_rollout.hf_sampling import parse_sampling
    from recipe_hacpo.workers.sample_tape import TapeMismatch, read_tape, write_tape

    model, tok = reference
    prompts = [_chat_ids(tok, t) for t in ("1+1=", "2+2=", "3+3=", "1+1=")]
    seeds = [11, 22, 33, 44]
    recorded_dir = tmp_path / "rec" / "a"
    cfg = _rollout_config(max_model_len=128, custom={"agent_name": "a", "record_samples": str(recorded_dir)})
    recorder = HFEngine(cfg, _model_config(tiny_model_path), seed=0)
    sampling = parse_sampling({"temperature": 1.0, "top_k": -1, "logprobs": True, "max_tokens": 12}, cfg, 40)
    recorded = recorder.generate(prompts, sampling, seeds)
    recorder.generate(prompts[:1], parse_sampling({"temperature": 0.0, "max_tokens": 4}, cfg, 40), [5])  # greedy
    tape = read_tape(recorded_dir)
    assert tape == {s: r.token_ids for s, r in zip(seeds, recorded)}

    def replayer(tape_dir):
        engine = HFEngine(_rollout_config(max_model_len=128, custom={"agent_name": "a", "replay_samples": str(tape_dir)}),
                          _model_config(tiny_model_path), seed=0)
        torch.manual_seed(7)
        with torch.no_grad():
            for p in engine.model.parameters():
                p.add_(0.5 * torch.randn_like(p) * p.std())
        return engine

    other = replayer(recorded_dir)
    free = HFEngine(cfg, _model_config(tiny_model_path), seed=0)
    free.model.load_state_dict(other.model.state_dict())
    free.tape_recorder = None
    # not vacuous: these weights, left to sample, draw other tokens for some request
    assert [r.token_ids for r in free.generate(prompts, sampling, seeds)] != [r.token_ids for r in recorded]
    replayed = other.generate(prompts, sampling, seeds)
    assert [r.token_ids for r in replayed] == [r.token_ids for r in recorded]
    assert [r.finished for r in replayed] == [r.finished for r in recorded]
    for prompt, out in zip(prompts, replayed):
        expected = _reference_token_scores(other.model, prompt, out.token_ids, temperature=1.0)
        assert torch.allclose(torch.tensor(out.log_probs), expected, atol=1e-5)

    with pytest.raises(TapeMismatch, match=r"^a: no recorded sample for request seed 99 \(1 of 2 requests\)"):
        other.generate(prompts[:2], sampling, [11, 99])
    # a tape line that ends before the generation does (no EOS, budget left)
    short = {s: t[:2] if s == 22 else t for s, t in tape.items()}
    assert not any(t in recorder.eos_token_ids for t in short[22])
    write_tape(short, tmp_path / "short" / "a" / "tape.jsonl")
    with pytest.raises(TapeMismatch, match=r"^a: request seed 22 generated \d+ tokens where the tape .* holds 2"):
        replayer(tmp_path / "short" / "a").generate(prompts, sampling, seeds)


def test_sample_tape_files_reject_bad_lines_and_conflicting_seeds(tmp_path):
    from recipe_hacpo.workers.sample_tape import read_tape

    (tmp_path / "a.jsonl").write_text('{"seed": 1, "tokens": [3, 4]}\n\n{"seed": 2, "tokens": []}\n')
    (tmp_path / "b.jsonl").write_text('{"seed": 1, "tokens": [3, 4]}\n')  # a step generated again: same tokens
    assert read_tape(tmp_path) == {1: [3, 4], 2: []}
    (tmp_path / "c.jsonl").write_text('{"seed": 1, "tokens": [3, 5]}\n')
    with pytest.raises(ValueError, match=r"c.jsonl:1: seed 1 recorded twice with different tokens"):
        read_tape(tmp_path)
    (tmp_path / "c.jsonl").write_text('{"seed": 1}\n')
    with pytest.raises(ValueError, match=r"c.jsonl:1: not a tape line"):
        read_tape(tmp_path)


def test_seeded_row_sampler_draws_from_the_warped_distribution(tiny_model_path, reference):
    """First-token frequencies over 4000 seeds match softmax(top-k(logits) / T)."""
    from recipe_hacpo.workers.hf_cpu_rollout.hf_engine import HFEngine
    from recipe_hacpo.workers.hf_cpu_rollout.hf_sampling import parse_sampling

    model, tok = reference
    cfg = _rollout_config(max_model_len=128)
    engine = HFEngine(cfg, _model_config(tiny_model_path), seed=0)
    prompt = _chat_ids(tok, "7*6=")
    sampling = parse_sampling({"temperature": 0.5, "top_k": 5, "max_tokens": 1}, cfg, len(prompt))
    n = 4000
    outs = engine.generate([prompt] * n, sampling, list(range(n)))
    counts = torch.bincount(torch.tensor([o.token_ids[0] for o in outs]), minlength=len(tok)).double()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].double()
    top = logits.topk(5).indices
    probs = torch.zeros_like(logits)
    probs[top] = torch.softmax(logits[top] / 0.5, -1)
    assert counts[probs == 0].sum() == 0  # nothing outside the top 5
    total_variation = 0.5 * (counts / n - probs).abs().sum().item()
    assert total_variation < 0.04, total_variation  # sampling noise alone: about 0.01


def test_request_seed_is_stable_and_separates_steps_rows_and_prompts():
    from recipe_hacpo.workers.seeded_sampling import request_seed

    base = request_seed(42, 3, "det-7", [1, 2, 3])
    assert base == request_seed(42, 3, "det-7", [1, 2, 3])  # no process-dependent hashing
    assert 0 <= base < 2**62
    others = {
        request_seed(43, 3, "det-7", [1, 2, 3]),
        request_seed(42, 4, "det-7", [1, 2, 3]),
        request_seed(42, 3, "det-8", [1, 2, 3]),
        request_seed(42, 3, "det-7", [1, 2, 4]),
        request_seed(42, 3, "det-7", [12, 3]),
    }
    assert base not in others and len(others) == 5


def test_engine_weight_sync_is_all_or_error(tiny_model_path):
    from recipe_hacpo.workers.hf_cpu_rollout.hf_engine import HFEngine

    cfg = _rollout_config(load_format="dummy", max_model_len=128)
    engine = HFEngine(cfg, _model_config(tiny_model_path), seed=0)
    state = {k: v.detach().clone() + 0.01 for k, v in engine.model.state_dict().items()}
    names = sorted(state)

    engine.begin_weight_update()
    engine.load_weights([(n, state[n]) for n in names[: len(names) // 2]])
    with pytest.raises(KeyError, match="untouched"):
        engine.finish_weight_update()

    engine.begin_weight_update()
    engine.load_weights([("not.a.weight", torch.zeros(1))])
    engine.load_weights(list(state.items()))
    with pytest.raises(KeyError, match="unknown"):
        engine.finish_weight_update()

    engine.begin_weight_update()
    engine.load_weights(list(state.items()))
    engine.finish_weight_update()
    for name, tensor in engine.model.state_dict().items():
        torch.testing.assert_close(tensor, state[name])


# ---------------------------------------------------------------------------------------
# 1. the server actor under Ray
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="class")
def ray_local():
    """A private local Ray cluster for one test class."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="class")
def server(ray_local, tiny_model_path):
    """One HF rollout server actor, as `HFReplica.launch_servers` would start it."""
    from recipe_hacpo.workers.hf_cpu_rollout.hf_rollout import server_actor_name
    from recipe_hacpo.workers.hf_cpu_rollout.hf_server import HFRolloutServer
    from verl.workers.rollout.replica import RolloutMode

    cfg = _rollout_config(custom={"agent_name": "unit"}, engine_kwargs={"hf": {"batch_wait_ms": 20}})
    name = server_actor_name(cfg, 0)
    handle = (
        ray_local.remote(HFRolloutServer)
        .options(name=name, num_cpus=0)
        .remote(
            config=cfg,
            model_config=_model_config(tiny_model_path),
            rollout_mode=RolloutMode.HYBRID,
            replica_rank=0,
            name=name,
        )
    )
    ray_local.get(handle.launch_server.remote())
    return handle


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    """The same checkpoint in this process, for forward-pass comparisons."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval(), AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.mark.ray
class TestHFRolloutServer:
    def _generate(self, server, prompts, **params):
        import ray

        refs = [
            server.generate.remote(prompt_ids=p, sampling_params=dict(params), request_id=str(i))
            for i, p in enumerate(prompts)
        ]
        return ray.get(refs)

    def test_sampled_logprobs_match_forward_pass(self, server, reference):
        model, tok = reference
        # Different prompt lengths, sent concurrently: they decode as one left-padded batch.
        prompts = [_chat_ids(tok, t) for t in ("1+1=", "what is 12*7? think step by step", "hi")] * 2
        outs = self._generate(server, prompts, temperature=0.8, top_p=1.0, top_k=-1, logprobs=True)
        for prompt, out in zip(prompts, outs, strict=True):
            assert out.token_ids and len(out.log_probs) == len(out.token_ids)
            expected = _reference_token_scores(model, prompt, out.token_ids, temperature=0.8)
            assert torch.allclose(torch.tensor(out.log_probs), expected, atol=1e-5), (out.log_probs, expected)

    def test_greedy_is_deterministic_and_matches_argmax(self, server, reference):
        model, tok = reference
        prompts = [_chat_ids(tok, t) for t in ("2+2=", "count: 1 2 3")]
        first = self._generate(server, prompts, temperature=0, logprobs=True, max_tokens=12)
        second = self._generate(server, prompts[::-1], temperature=0, logprobs=True, max_tokens=12)[::-1]
        assert [o.token_ids for o in first] == [o.token_ids for o in second]
        for prompt, out in zip(prompts, first, strict=True):
            ids = list(prompt)
            for _ in range(len(out.token_ids)):
                with torch.no_grad():
                    ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            assert out.token_ids == ids[len(prompt) :]
            # Greedy log-probs are the untempered distribution's.
            expected = _reference_token_scores(model, prompt, out.token_ids, temperature=1.0)
            assert torch.allclose(torch.tensor(out.log_probs), expected, atol=1e-5)

    def test_sampling_knobs_are_honoured(self, server, reference):
        _, tok = reference
        prompt = [_chat_ids(tok, "7*6=")]
        greedy = self._generate(server, prompt, temperature=0, max_tokens=10)[0].token_ids
        assert self._generate(server, prompt, temperature=1.0, top_k=1, max_tokens=10)[0].token_ids == greedy
        assert self._generate(server, prompt, temperature=1.0, top_p=1e-6, max_tokens=10)[0].token_ids == greedy
        assert len(self._generate(server, prompt, temperature=1.0, max_tokens=3)[0].token_ids) == 3

    def test_stop_reasons(self, server, reference):
        _, tok = reference
        prompt = [_chat_ids(tok, "9-4=")]
        capped = self._generate(server, prompt, temperature=0, max_tokens=8)[0]
        assert len(capped.token_ids) == 8
        assert (capped.stop_reason, capped.extra_fields["finish_reason"]) == ("length", "length")

        # A stop token takes the same path as EOS: kept as the last token, reason "completed".
        stop_at = capped.token_ids[3]
        stopped = self._generate(server, prompt, temperature=0, max_tokens=8, stop_token_ids=[stop_at])[0]
        assert stopped.token_ids == capped.token_ids[: capped.token_ids.index(stop_at) + 1]
        assert (stopped.stop_reason, stopped.extra_fields["finish_reason"]) == ("completed", "stop")

    def test_eos_ids_cover_tokenizer_and_generation_config(self, tiny_model_path):
        from recipe_hacpo.workers.hf_cpu_rollout.hf_engine import _eos_ids

        mc = _model_config(tiny_model_path)
        assert mc.tokenizer.eos_token_id in _eos_ids(mc)

    def test_sleep_blocks_generation_until_wake(self, server, reference):
        import ray

        _, tok = reference
        prompt = _chat_ids(tok, "x")
        ray.get(server.sleep.remote())
        with pytest.raises(ray.exceptions.RayTaskError, match="released"):
            ray.get(server.generate.remote(prompt_ids=prompt, sampling_params={"max_tokens": 2}, request_id="s"))
        ray.get(server.wake_up.remote(tags=["weights"]))
        ray.get(server.wake_up.remote(tags=["kv_cache"]))
        assert len(self._generate(server, [prompt], max_tokens=2)[0].token_ids) >= 1


# ---------------------------------------------------------------------------------------
# 2. unmodified verl main_ppo, 2 GSPO steps on CPU
# ---------------------------------------------------------------------------------------

REWARD_SOURCE = textwrap.dedent(
    """
    def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        # Dense and non-constant on random text, so GRPO advantages are non-zero.
        if not solution_str:
            return 0.0
        return sum(c.isdigit() for c in solution_str) / len(solution_str)
    """
)


def _write_parquet(path: str, n: int, split: str) -> None:
    import pandas as pd

    rows = [
        {
            "data_source": "tiny_arith",
            "prompt": [{"role": "user", "content": f"{i + 2}+{3 * i + 1}="}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(4 * i + 3)},
            "extra_info": {"index": i, "split": split},
        }
        for i in range(n)
    ]
    pd.DataFrame(rows).to_parquet(path)


def _load_safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


@pytest.mark.ray
@pytest.mark.timeout(420)
def test_main_ppo_trains_two_gspo_steps_with_hf_rollout(tmp_path, tiny_model_path):
    train, val = str(tmp_path / "train.parquet"), str(tmp_path / "val.parquet")
    _write_parquet(train, 16, "train")
    _write_parquet(val, 4, "test")
    reward_path = tmp_path / "reward_fn.py"
    reward_path.write_text(REWARD_SOURCE)

    overrides = ppo_overrides(tiny_model_path, train, val, str(reward_path), str(tmp_path))
    overrides += [
        # Exercise the per-agent server name (replica and adapter must agree on it).
        "+actor_rollout_ref.rollout.custom.agent_name=solo",
        # Save the actor as HF weights at the last step to compare with the start.
        "trainer.save_freq=2",
        "actor_rollout_ref.actor.checkpoint.save_contents=[hf_model]",
        "+ray_kwargs.ray_init.address=local",
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", *overrides],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=400,
    )
    log = proc.stdout
    assert proc.returncode == 0, log[-6000:]

    steps = parse_console_steps(log)
    assert set(steps) >= {1, 2}, log[-4000:]
    for step in (1, 2):
        m = steps[step]
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/score/mean"):
            assert math.isfinite(m[key]), (step, key, m.get(key))
        assert m["actor/grad_norm"] > 0
        # Rollout log-probs (hf server) vs the FSDP actor's recomputation: equal only if the
        # weight sync delivered the actor's current weights (the rollout starts random).
        assert m["training/rollout_probs_diff_max"] < 1e-4, m["training/rollout_probs_diff_max"]

    saved = _load_safetensors(str(tmp_path / "ckpt" / "global_step_2" / "actor" / "huggingface" / "model.safetensors"))
    initial = _load_safetensors(os.path.join(tiny_model_path, "model.safetensors"))
    moved = 0.0
    for name, tensor in initial.items():
        assert torch.isfinite(saved[name]).all(), name
        moved = max(moved, (saved[name].float() - tensor.float()).abs().max().item())
    assert moved > 1e-6, "actor weights did not change"
    json.dumps(steps)  # metrics are plain floats
