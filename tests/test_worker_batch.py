"""What `AgentRuntime` ships to an agent's workers: tensors and the call's scalars, no per-row
text or object field.

The learner batch on the driver keeps the dataset's fields (prompt, ground truth, data
source, uid, response text) for the trainer's checks, dumps and metrics. verl's engine and
the HACPO loss read none of them, and each one costs a pickled Python object per row on
every worker call, so `worker_tensordict` leaves them out. A text field that finds its way
back into the update or log-prob batch fails here; so does a field the loss reads going missing.
No Ray: the worker group is a stand-in that records what it was sent.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tensordict import NonTensorStack
from verl import DataProto
from verl.utils import tensordict_utils as tu

from recipe_hacpo import batch_keys as K
from recipe_hacpo.training.agent_runtime import WORKER_NON_TENSOR_FIELDS, AgentRuntime
from recipe_hacpo.exchange.retokenize import pack_rows
from recipe_hacpo.methods.hacpo import hacpo_loss_fields
from recipe_hacpo.methods.rows import LEARNER_NON_TENSORS, concat_rows, tag_rows

PROMPTS, N = 4, 2  # rows per prompt per agent


class _RecordingWorkers:
    """Stands in for the agent's RayWorkerGroup: keeps every TensorDict it is sent."""

    world_size = 1

    def __init__(self):
        self.sent: dict[str, object] = {}

    def update_actor(self, td):
        self.sent["update_actor"] = td
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": {"actor/pg_loss": [0.5]}})

    def compute_log_prob(self, td):
        self.sent["compute_log_prob"] = td
        lengths = td["input_ids"].offsets().diff()
        values = torch.full((int(lengths.sum()),), -1.0)
        log_probs = torch.nested.nested_tensor_from_jagged(values, td["input_ids"].offsets())
        return tu.get_tensordict(tensor_dict={"log_probs": log_probs})

    def compute_ref_log_prob(self, td):
        out = self.compute_log_prob(td)
        self.sent["compute_ref_log_prob"] = self.sent.pop("compute_log_prob")
        return out

    def hacpo_update_record(self):
        return [[{"update_index": 0, "own_rows": 1, "cross_rows": 1, "lower_bound": 0.8}]]


def _runtime(paths, extra: tuple[str, ...] = ()):
    from hydra import compose, initialize_config_module

    from recipe_hacpo.config import agent_verl_config, validate

    with initialize_config_module("recipe_hacpo.configs", version_base=None):
        cfg = compose("hacpo_cpu_demo", overrides=[
            f"agents.qwen_char.model_path={paths['qwen2-char-small']}",
            f"agents.llama_pair.model_path={paths['llama-pair-medium']}",
            f"data.train_batch_size={PROMPTS}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            *extra,
        ])
    specs, _ = validate(cfg)
    runtime = AgentRuntime(spec=specs[0], config=agent_verl_config(cfg, specs[0]), device_name="cpu")
    runtime.wg = _RecordingWorkers()
    return runtime


def _rollout(seed: int) -> DataProto:
    """One agent's scored rollout as the trainer holds it after scoring: layout, rewards,
    old log-probs, and the dataset's per-row fields plus the decoded response text."""
    g = torch.Generator().manual_seed(seed)
    rows = PROMPTS * N
    def tokens(low: int, high: int) -> list[int]:
        return torch.randint(3, 40, (int(torch.randint(low, high, (1,), generator=g)),), generator=g).tolist()

    prompts = [tokens(3, 7) for _ in range(rows)]
    responses = [tokens(1, 6) for _ in range(rows)]
    tensors = pack_rows(prompts, responses, pad_id=0, prompt_width=8, response_width=6)
    mask = tensors["response_mask"]
    tensors.update({
        "old_log_probs": -torch.rand(mask.shape, generator=g) * mask,
        K.REWARD: (torch.rand(rows, generator=g) > 0.5).float(),
        K.SOURCE_LOG_PROB_MEAN: -torch.rand(rows, generator=g),
        K.SOURCE_RESPONSE_LENGTH: mask.sum(-1).float(),
    })
    obj = lambda values: np.array(values, dtype=object)  # noqa: E731
    non_tensors = {
        "uid": obj([f"step1-prompt{i // N}" for i in range(rows)]),
        "raw_prompt": obj([[{"role": "user", "content": f"{i} + {i} ="}] for i in range(rows)]),
        "data_source": obj(["arith"] * rows),
        "reward_model": obj([{"ground_truth": str(2 * i), "style": "rule"} for i in range(rows)]),
        "extra_info": obj([{"index": i} for i in range(rows)]),
        K.RESPONSE_TEXT: obj([f"answer {i}" for i in range(rows)]),
    }
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info={"temperature": 1.0})


def _learner_batch() -> DataProto:
    """Own rows and a peer's rows, concatenated by the trainer's own code, with advantages."""
    batch = concat_rows([
        tag_rows(_rollout(0), source=0, cross=False, omega=1.0),
        tag_rows(_rollout(1), source=1, cross=True, omega=1.3),
    ])
    mask = batch.batch["response_mask"]
    batch.batch["advantages"] = torch.randn(len(batch), 1, generator=torch.Generator().manual_seed(2)) * mask
    batch.batch["returns"] = batch.batch["advantages"]
    return batch


def _per_row_objects(td) -> list[str]:
    """Keys of `td` that carry one Python object per row (verl's NonTensorStack)."""
    return sorted(k for k in td.keys() if isinstance(td.get(k), NonTensorStack))


def test_update_ships_tensors_the_loss_reads_and_no_text_field(tiny_agent_paths):
    runtime = _runtime(tiny_agent_paths)
    batch = _learner_batch()
    # the driver's learner batch does carry the text fields (what the trainer dumps and checks)
    assert set(LEARNER_NON_TENSORS) <= set(batch.non_tensor_batch)

    runtime.update(batch, rows_per_prompt=2 * N)

    sent = runtime.wg.sent["update_actor"]
    assert _per_row_objects(sent) == [], "a per-row object field is shipped to the update"
    for key in LEARNER_NON_TENSORS:
        assert key not in sent.keys(), key
    needed = set(hacpo_loss_fields(SimpleNamespace(cross_ratio_length="source")))
    needed |= {"input_ids", "position_ids", "attention_mask", "prompts", "responses", "loss_mask"}
    assert needed <= set(sent.keys()), needed - set(sent.keys())
    assert sent.shape[0] == len(batch)
    # the call's scalars still reach the worker (verl's mini-batching, the sampling temperature)
    assert tu.get_non_tensor_data(sent, "mini_batch_size", None) == 2 * 2 * N
    assert tu.get_non_tensor_data(sent, "temperature", None) == 1.0
    # the driver's batch itself is left whole
    assert set(LEARNER_NON_TENSORS) <= set(batch.non_tensor_batch)


@pytest.mark.parametrize("call", ["old_log_prob", "ref_log_prob"])
def test_log_prob_calls_ship_no_text_field(tiny_agent_paths, call):
    runtime = _runtime(tiny_agent_paths)
    rollout = _rollout(0)
    out = getattr(runtime, call)(rollout)

    sent = runtime.wg.sent["compute_ref_log_prob" if call == "ref_log_prob" else "compute_log_prob"]
    assert _per_row_objects(sent) == []
    assert {"input_ids", "position_ids", "prompts", "responses", "response_mask"} <= set(sent.keys())
    assert out.shape == rollout.batch["responses"].shape
    # the worker's log-probs come back on the response tokens
    assert (out[rollout.batch["response_mask"].bool()] == -1.0).all()


def test_a_lora_agents_reference_is_its_actor_with_the_adapter_off(tiny_agent_paths):
    lora = ("+agents.qwen_char.actor_rollout_ref.model.lora_rank=4", "+agents.qwen_char.actor_rollout_ref.model.lora.merge=true")
    runtime = _runtime(tiny_agent_paths, lora)
    assert runtime.ref_in_actor and not _runtime(tiny_agent_paths).ref_in_actor
    runtime.ref_log_prob(_rollout(0))
    # verl's actor worker, told to switch its adapter off; no reference worker is asked
    assert set(runtime.wg.sent) == {"compute_log_prob"}
    assert tu.get_non_tensor_data(runtime.wg.sent["compute_log_prob"], "no_lora_adapter", None) is True


def test_a_field_verl_reads_per_row_is_still_shipped(tiny_agent_paths):
    """verl's engine reads `multi_modal_inputs` per row; it is the one object field kept."""
    assert WORKER_NON_TENSOR_FIELDS == ("multi_modal_inputs",)
    runtime = _runtime(tiny_agent_paths)
    rollout = _rollout(0)
    rollout.non_tensor_batch["multi_modal_inputs"] = np.array([{} for _ in range(len(rollout))], dtype=object)
    runtime.old_log_prob(rollout)
    assert _per_row_objects(runtime.wg.sent["compute_log_prob"]) == ["multi_modal_inputs"]
