"""Evaluation on CPU: metric definitions against hand-computed values, Table 1 layout in
markdown and CSV, the HF backend on a tiny model, and trainer (FSDP) checkpoints."""

from __future__ import annotations

import csv
import json
import os
import shutil
import types

import pytest
import torch

from recipe_hacpo import evaluate as ev
from recipe_hacpo.evaluation import benchmarks as evb
from recipe_hacpo.evaluation import checkpoints as evc
from recipe_hacpo.evaluation import generators as evg
from recipe_hacpo.data.schema import make_row, write_rows
from helpers.evaluation import QUESTIONS, SOURCES, write_bench as _bench

# (key, data_source as recipe_hacpo.data.prepare writes it)
HEADER = ["Method", "MATH-500", "MATH", "GSM8K", "AIME25", "AMC23", "Minerva", "OlympiadBench", "AVG"]


# --------------------------------------------------------------------------- metrics


SCORES = [[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]]


def test_metrics_match_hand_computed_values():
    assert evb.avg_at_k(SCORES, 1) == pytest.approx((1 + 0 + 1) / 3)
    assert evb.avg_at_k(SCORES, 4) == pytest.approx((0.5 + 0 + 1) / 3)
    assert evb.best_at_k(SCORES, 1) == pytest.approx(2 / 3)
    assert evb.best_at_k(SCORES, 3) == pytest.approx(2 / 3)
    assert evb.best_at_k([[0, 0, 1], [0, 0, 0]], 2) == 0.0
    assert evb.best_at_k([[0, 0, 1], [0, 0, 0]], 3) == 0.5
    # prompt 1: n=4, c=2, k=2 -> 1 - C(2,2)/C(4,2) = 5/6; prompt 2: 0; prompt 3: 1
    assert evb.pass_at_k(SCORES, 2) == pytest.approx((5 / 6 + 0 + 1) / 3)
    # pass@1 is the mean accuracy over all samples
    assert evb.pass_at_k(SCORES, 1) == pytest.approx(evb.avg_at_k(SCORES, 4))
    # with n == k the unbiased estimator is best@k
    assert evb.pass_at_k(SCORES, 4) == pytest.approx(evb.best_at_k(SCORES, 4))
    assert evb.pass_at_k_one(30, 1, 30) == 1.0 and evb.pass_at_k_one(30, 0, 5) == 0.0
    assert evb.pass_at_k_one(10, 3, 2) == pytest.approx(1 - (7 * 6) / (10 * 9))
    assert evb.Metric.parse("best@30").compute([[0] * 29 + [1], [0] * 30]) == 0.5
    with pytest.raises(ev.EvalError, match="at least k samples"):
        evb.avg_at_k(SCORES, 5)
    with pytest.raises(ev.EvalError, match="avg@k, best@k or pass@k"):
        evb.Metric.parse("mean@3")


def test_benchmark_names_defaults_and_column_order(tmp_path):
    for key in SOURCES:
        _bench(tmp_path, key)
    benches = ev.build_benchmarks(None, str(tmp_path), ["AMC-23=pass@2"], ["amc23=4"])
    assert [b.label for b in benches] == HEADER[1:-1]
    by_key = {b.key: b for b in benches}
    assert str(by_key["aime25"].metric) == "best@30" and by_key["aime25"].n == 30
    assert str(by_key["math500"].metric) == "avg@1" and by_key["math500"].n == 1
    assert (str(by_key["amc23"].metric), by_key["amc23"].n) == ("pass@2", 4)
    assert evb.bench_key("MATH-500") == "math500" and evb.bench_key("aime2025") == "aime25"
    with pytest.raises(ev.EvalError, match="fewer than the k"):
        ev.build_benchmarks(None, str(tmp_path), None, ["aime25=8"])
    with pytest.raises(ev.EvalError, match="not evaluated"):
        ev.build_benchmarks([f"gsm8k={tmp_path}/gsm8k_test.parquet"], None, ["aime25=avg@1"], None)


# --------------------------------------------------------------------------- Table 1 end to end


class CannedGenerator:
    """Answers the benchmarks in the order evaluate() asks: `plan[bench]` holds, per prompt,
    the sample indices whose response is correct; every other response is wrong."""

    def __init__(self, plan: dict, calls: list):
        self.plan, self.calls = plan, calls
        self.order = [k for k, _ in evb.BENCHMARKS]

    def generate(self, prompts, n, temperature, seed):
        key = self.order.pop(0)
        self.calls.append((key, n, temperature))
        out = []
        for (_, correct), messages in zip(self.plan[key], prompts):
            answer = next(a for q, a in QUESTIONS if q in messages[-1]["content"])
            out.append([f"So the answer is \\boxed{{{answer if j in correct else 999}}}." for j in range(n)])
        return out

    def close(self):
        pass


def _plan(n_by_bench: dict, correct: dict) -> dict:
    return {k: [(n_by_bench[k], set(c)) for c in correct[k]] for k in n_by_bench}


def test_table1_from_canned_responses(tmp_path, monkeypatch, tiny_agent_paths):
    bench_dir = tmp_path / "bench"
    files = {key: _bench(bench_dir, key) for key in SOURCES}
    n = {k: 1 for k in SOURCES} | {"aime25": 30, "amc23": 4}
    one_of_two = [[0], []]
    plans = {
        tiny_agent_paths["qwen2-char-small"]: _plan(
            n,
            {k: one_of_two for k in SOURCES}
            | {"aime25": [[7], []], "amc23": [[0, 3], []]},
        ),
        tiny_agent_paths["llama-pair-medium"]: _plan(
            n,
            {k: [[0], [0]] for k in SOURCES}
            | {"gsm8k": [[], []], "aime25": [[], [0, 29]], "amc23": [[0, 1, 2, 3], [0, 1, 2, 3]]},
        ),
    }
    calls: list = []

    def fake_make_generator(backend, model_dir, opts):
        assert backend == "hf"
        return CannedGenerator(plans[model_dir], calls)

    monkeypatch.setattr(ev, "make_generator", fake_make_generator)
    out = tmp_path / "out"
    # benchmarks given out of the paper's order; the table puts them in its order
    bench_args = []
    for key in reversed(list(SOURCES)):
        bench_args += ["--bench", f"{key}={files[key]}"]
    rc = ev.main(
        ["--checkpoint", f"alpha={tiny_agent_paths['qwen2-char-small']}",
         "--checkpoint", f"beta={tiny_agent_paths['llama-pair-medium']}",
         *bench_args, "--metric", "amc23=pass@2", "--samples", "amc23=4",
         "--backend", "hf", "--temperature", "0.7", "--out", str(out)]
    )
    assert rc == 0
    # one sample: greedy; several: the sampling temperature
    assert ("math500", 1, 0.0) in calls and ("aime25", 30, 0.7) in calls and ("amc23", 4, 0.7) in calls
    assert len(calls) == 14

    alpha_amc = (5 / 6 + 0) / 2  # n=4, c=2, k=2 on prompt 1; nothing right on prompt 2
    alpha = [0.5, 0.5, 0.5, 0.5, alpha_amc, 0.5, 0.5]
    beta = [1.0, 1.0, 0.0, 0.5, 1.0, 1.0, 1.0]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["alpha"]["amc23"]["value"] == pytest.approx(alpha_amc)
    assert metrics["alpha"]["amc23"]["metrics"]["avg@4"] == pytest.approx(0.25)
    assert metrics["alpha"]["amc23"]["metrics"]["best@4"] == pytest.approx(0.5)
    assert metrics["beta"]["aime25"]["metric"] == "best@30"
    assert metrics["beta"]["aime25"]["metrics"]["avg@30"] == pytest.approx(2 / 60)

    md = (out / "table.md").read_text().splitlines()
    assert md[0] == "| " + " | ".join(HEADER) + " |"
    assert md[1] == "| --- |" + " ---: |" * 8
    fmt = lambda vals: " | ".join(f"{v:.3f}" for v in vals + [sum(vals) / 7])  # noqa: E731
    assert md[2] == f"| alpha | {fmt(alpha)} |"
    assert md[3] == f"| beta | {fmt(beta)} |"
    assert "AIME25 best@30" in md[5] and "AMC23 pass@2" in md[5] and "MATH-500 avg@1" in md[5]

    with open(out / "table.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == HEADER
    assert [r[0] for r in rows[1:]] == ["alpha", "beta"]
    assert [float(v) for v in rows[1][1:]] == pytest.approx(alpha + [sum(alpha) / 7], abs=1e-6)
    assert [float(v) for v in rows[2][1:]] == pytest.approx(beta + [sum(beta) / 7], abs=1e-6)

    record = json.loads((out / "samples" / "beta" / "aime25.jsonl").read_text().splitlines()[1])
    assert len(record["responses"]) == 30 and record["scores"][0] == 1.0 and sum(record["scores"]) == 2


def test_hf_backend_on_a_tiny_model(tmp_path, tiny_agent_paths):
    bench = _bench(tmp_path, "gsm8k")
    model = tiny_agent_paths["qwen2-char-small"]
    opts = ev.GenOptions(backend="hf", max_new_tokens=4, batch_size=2, device="cpu")
    gen = ev.make_generator("hf", model, opts)
    prompts = [r["messages"] for r in ev.load_benchmark(bench)]
    greedy = gen.generate(prompts, 1, 0.0, 0)
    assert greedy == gen.generate(prompts, 1, 0.0, 1) and [len(r) for r in greedy] == [1, 1]
    sampled = gen.generate(prompts, 3, 1.0, 0)
    assert [len(r) for r in sampled] == [3, 3] and all(isinstance(t, str) for r in sampled for t in r)

    out = tmp_path / "out"
    rc = ev.main(["--checkpoint", f"tiny={model}", "--bench", f"GSM8K={bench}", "--metric", "gsm8k=best@2",
                  "--backend", "hf", "--device", "cpu", "--max-new-tokens", "4", "--out", str(out),
                  "--chat-template-kwargs", '{"enable_thinking": false}'])
    assert rc == 0
    md = (out / "table.md").read_text().splitlines()
    assert md[0] == "| Method | GSM8K | AVG |" and md[2].startswith("| tiny | ")
    lines = (out / "samples" / "tiny" / "gsm8k.jsonl").read_text().splitlines()
    assert [len(json.loads(x)["responses"]) for x in lines] == [2, 2]
    value = json.loads((out / "metrics.json").read_text())["tiny"]["gsm8k"]["value"]
    assert 0.0 <= value <= 1.0


def test_cli_errors_are_one_line(tmp_path, capsys):
    bench = _bench(tmp_path, "gsm8k")
    assert ev.main(["--checkpoint", "x", "--bench", f"gsm8k={bench}", "--out", str(tmp_path / "o")]) == 2
    assert "expected NAME=VALUE" in capsys.readouterr().err
    assert ev.main(["--agents-from", str(tmp_path), "--bench", f"gsm8k={bench}", "--out", str(tmp_path / "o")]) == 2
    assert "no <agent>/actor folders" in capsys.readouterr().err
    bad = ["--checkpoint", f"x={tmp_path}", "--bench", f"gsm8k={bench}", "--chat-template-kwargs", "{no", "--out", str(tmp_path / "o")]
    assert ev.main(bad) == 2 and "--chat-template-kwargs: not JSON" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert ev.main(["--checkpoint", f"x={empty}", "--bench", f"gsm8k={bench}", "--backend", "hf", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "neither a Hugging Face model dir" in err and err.count("\n") == 1


# --------------------------------------------------------------------------- trainer checkpoints


def _fsdp_checkpoint(model_dir: str, actor: str) -> dict:
    """Save `model_dir` the way the trainer does with one rank: FSDP2 DTensor state dict + huggingface/."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    assert not dist.is_initialized()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # differs from the weights in model_dir
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    os.makedirs(os.path.join(actor, "huggingface"))
    for name in os.listdir(model_dir):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(model_dir, name), os.path.join(actor, "huggingface", name))
    dist.init_process_group("gloo", init_method=f"file://{actor}/.store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        state = model.state_dict()
        assert type(state["model.embed_tokens.weight"]).__name__ == "DTensor"
        torch.save(state, os.path.join(actor, "model_world_size_1_rank_0.pt"))
    finally:
        dist.destroy_process_group()
    return expected


@pytest.mark.parametrize("kind", ["qwen2-char-small", "llama-pair-medium"])
def test_world_size_one_trainer_checkpoint_is_merged(tmp_path, tiny_agent_paths, kind):
    from transformers import AutoModelForCausalLM

    actor = tmp_path / "global_step_3" / "agent_a" / "actor"
    expected = _fsdp_checkpoint(tiny_agent_paths[kind], str(actor))
    merged_dir = ev.resolve_checkpoint(str(tmp_path / "global_step_3" / "agent_a"), str(tmp_path / "models" / "a"))
    assert merged_dir == str(tmp_path / "models" / "a")
    assert os.path.isfile(os.path.join(merged_dir, "tokenizer_config.json"))
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).state_dict()
    assert set(merged) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(merged[key], value, msg=key)
    # the actor dir itself works as well
    assert ev.resolve_checkpoint(str(actor), str(tmp_path / "models" / "b")) == str(tmp_path / "models" / "b")


def test_shard_merging_rules_and_unsupported_layouts(tmp_path):
    from torch.distributed.tensor import Replicate, Shard

    def dt(parts, placements):
        full = torch.cat(parts, dim=placements[0].dim) if placements[0].is_shard() else parts[0]
        return [types.SimpleNamespace(to_local=lambda p=p: p, placements=placements, shape=full.shape) for p in parts], full

    rows, rows_full = dt([torch.arange(6.0).view(2, 3), torch.arange(6.0, 9.0).view(1, 3)], (Shard(0),))
    cols, cols_full = dt([torch.ones(2, 1), torch.zeros(2, 2)], (Shard(1),))
    rep, rep_full = dt([torch.full((2,), 3.0), torch.full((2,), 3.0)], (Replicate(),))
    states = [{"a": rows[r], "_fsdp_wrapped_module.b": cols[r], "c": rep[r], "step": 1} for r in range(2)]
    merged = evc.merge_shards(states)
    assert set(merged) == {"a", "b", "c"}
    torch.testing.assert_close(merged["a"], rows_full)
    torch.testing.assert_close(merged["b"], cols_full)
    torch.testing.assert_close(merged["c"], rep_full)

    with pytest.raises(ev.EvalError, match="FSDP1 flat shards.*verl.model_merger"):
        evc.merge_shards([{"w": torch.ones(2)}, {"w": torch.ones(2)}])
    two_d = types.SimpleNamespace(to_local=lambda: torch.ones(2), placements=(Replicate(), Shard(0)), shape=(4,))
    with pytest.raises(ev.EvalError, match="2-D device mesh.*verl.model_merger"):
        evc.merge_shards([{"w": two_d}])

    actor = tmp_path / "actor"
    (actor / "huggingface").mkdir(parents=True)
    (actor / "huggingface" / "config.json").write_text("{}")
    torch.save({}, actor / "model_world_size_2_rank_0.pt")
    with pytest.raises(ev.EvalError, match="world size 2 but rank 1 is missing"):
        ev.resolve_checkpoint(str(actor), str(tmp_path / "m"))


def test_agents_from_a_trainer_checkpoint_root(tmp_path, tiny_agent_paths):
    root = tmp_path / "checkpoints"
    for agent, kind in (("qwen_char", "qwen2-char-small"), ("llama_pair", "llama-pair-medium")):
        # a run that saved full HF weights next to the shards: used as they are
        shutil.copytree(tiny_agent_paths[kind], root / "global_step_4" / agent / "actor" / "huggingface")
    (root / "global_step_2" / "qwen_char" / "actor").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("4")
    found = ev.agent_checkpoints(f"hacpo={root}")
    assert found == [
        ("hacpo/llama_pair", str(root / "global_step_4" / "llama_pair")),
        ("hacpo/qwen_char", str(root / "global_step_4" / "qwen_char")),
    ]
    assert ev.resolve_checkpoint(found[1][1], str(tmp_path / "unused")) == str(
        root / "global_step_4" / "qwen_char" / "actor" / "huggingface"
    )
    assert [n for n, _ in ev.agent_checkpoints(str(root / "global_step_2"))] == ["qwen_char"]
    with pytest.raises(ev.EvalError, match="no <agent>/actor folders"):
        ev.agent_checkpoints(str(tmp_path))


# --------------------------------------------------------------------------- one engine per process


def test_gpu_groups_follow_tensor_parallel_size(monkeypatch):
    assert ev.gpu_groups("0,1,2,3", 1) == ["0", "1", "2", "3"]
    assert ev.gpu_groups("0,1,2,3", 2) == ["0,1", "2,3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert ev.gpu_groups(None, 1) == ["4", "5"]
    with pytest.raises(ev.EvalError, match=r"--gpus 0,1,2: 3 GPUs do not split into groups of --tensor-parallel-size 2"):
        ev.gpu_groups("0,1,2", 2)


def test_shutdown_stops_the_engine_core():
    calls = []
    core = types.SimpleNamespace(shutdown=lambda: calls.append("core"))
    evg.shutdown_vllm(types.SimpleNamespace(llm_engine=types.SimpleNamespace(engine_core=core, shutdown=lambda: calls.append("engine"))))
    assert calls == ["core"]
    evg.shutdown_vllm(types.SimpleNamespace(llm_engine=types.SimpleNamespace(shutdown=lambda: calls.append("engine"))))
    assert calls == ["core", "engine"]
    evg.shutdown_vllm(None)  # nothing to stop


def test_checkpoints_in_their_own_processes_match_in_process(tmp_path, tiny_agent_paths):
    bench = ev.Benchmark("gsm8k", _bench(tmp_path, "gsm8k"), evb.Metric("avg", 1), 1)
    opts = ev.GenOptions(backend="hf", max_new_tokens=4, batch_size=2, device="cpu")
    checkpoints = [("a", tiny_agent_paths["qwen2-char-small"]), ("b", tiny_agent_paths["llama-pair-medium"])]
    logs: list[str] = []
    inproc = ev.evaluate(checkpoints, [bench], str(tmp_path / "inproc"), opts, log=logs.append, isolate=False)
    spread = ev.evaluate(checkpoints, [bench], str(tmp_path / "spread"), opts, log=logs.append, gpus="6,7", isolate=True)
    assert list(spread) == ["a", "b"]
    assert {n: r["gsm8k"]["value"] for n, r in spread.items()} == {n: r["gsm8k"]["value"] for n, r in inproc.items()}
    # the two checkpoints went to the two GPU groups
    assert sorted(line for line in logs if "on GPU(s)" in line) == ["[a] on GPU(s) 6", "[b] on GPU(s) 7"]
    for name in ("a", "b"):
        assert (tmp_path / "spread" / "samples" / name / "gsm8k.jsonl").read_text() == (
            tmp_path / "inproc" / "samples" / name / "gsm8k.jsonl").read_text()


def test_a_failing_checkpoint_process_is_one_line(tmp_path, tiny_agent_paths):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_agent_paths["qwen2-char-small"], broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    bench = ev.Benchmark("gsm8k", _bench(tmp_path, "gsm8k"), evb.Metric("avg", 1), 1)
    opts = ev.GenOptions(backend="hf", max_new_tokens=2, device="cpu")
    with pytest.raises(ev.EvalError, match=r"^checkpoint broken: \w+") as err:
        ev.evaluate([("broken", str(broken))], [bench], str(tmp_path / "out"), opts, log=lambda m: None, gpus="0", isolate=True)
    assert "\n" not in str(err.value)


def test_main_table_defaults_to_the_papers_generation_limit(capsys):
    # the paper's main tables: at most 8196 new tokens per response
    assert ev.GenOptions().max_new_tokens == 8196
    with pytest.raises(SystemExit):
        ev.main(["--help"])
    assert "default 8196" in " ".join(capsys.readouterr().out.split())


def test_isolated_checkpoints_from_the_command_line(tmp_path, tiny_agent_paths):
    """`python -m recipe_hacpo.evaluate` is `__main__`: its per-checkpoint processes must still start."""
    import subprocess
    import sys

    bench = _bench(tmp_path, "gsm8k")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "recipe_hacpo.evaluate", "--checkpoint", f"a={tiny_agent_paths['qwen2-char-small']}",
         "--checkpoint", f"b={tiny_agent_paths['llama-pair-medium']}", "--bench", f"GSM8K={bench}",
         "--backend", "hf", "--device", "cpu", "--max-new-tokens", "2", "--isolate", "--gpus", "0,1", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[a] on GPU(s) 0" in proc.stdout and "[b] on GPU(s) 1" in proc.stdout
    assert set(json.loads((out / "metrics.json").read_text())) == {"a", "b"}
    assert (out / "table.md").read_text().splitlines()[2].startswith("| a | ")


# --------------------------------------------------------------------------- the paper's average


def _result(values: dict, metrics: dict | None = None) -> dict:
    metrics = metrics or {}
    return {k: {"metric": metrics.get(k, "best@30" if k == "aime25" else "avg@1"), "value": v} for k, v in values.items()}


# the seven in the paper's order, then an extra benchmark the paper's average leaves out
HAND_TABLE = {
    # (0.5 + 0.6 + 0.9 + 0.1 + 0.4 + 0.3 + 0.2) / 7 = 3.0 / 7 = 0.428571...
    "gspo": _result(dict(math500=0.5, math=0.6, gsm8k=0.9, aime25=0.1, amc23=0.4, minerva=0.3, olympiadbench=0.2)),
    # 3.5 / 7 = 0.5 exactly; the extra column (1.0) would make it 0.5625
    "hacpo": _result(dict(math500=0.6, math=0.7, gsm8k=0.9, aime25=0.2, amc23=0.5, minerva=0.35, olympiadbench=0.25,
                          svamp=1.0)),
    "partial": _result(dict(math500=0.6, math=0.7, gsm8k=0.9, minerva=0.3, olympiadbench=0.2)),
}


def test_paper_average_over_the_seven_from_a_hand_built_table():
    from recipe_hacpo.evaluation import tables

    assert tables.paper_average(HAND_TABLE["gspo"]) == pytest.approx(3.0 / 7)
    assert tables.paper_average(HAND_TABLE["hacpo"]) == pytest.approx(0.5)
    assert tables.paper_average(HAND_TABLE["partial"]) is None
    assert [tables.paper_figure(v) for v in (3.0 / 7, 0.5, 0.0405, 1.0)] == [".429", ".500", ".041", "1.000"]
    other = {"other": _result({k: v["value"] for k, v in HAND_TABLE["gspo"].items()}, {"amc23": "pass@2"})}
    assert tables.format_paper_average({**HAND_TABLE, **other}).splitlines() == [
        "AVG over the paper's 7 benchmarks (MATH-500, MATH, GSM8K, AIME25, AMC23, Minerva, OlympiadBench), "
        "as in docs/REPRODUCE.md, Expected numbers:",
        "| checkpoint | AVG |",
        "| --- | ---: |",
        "| gspo | .429 |",
        "| hacpo | .500 |",
        "| partial | not made: no AIME25, AMC23 |",
        "| other | .429 (AMC23 pass@2: not the paper's metric) |",
    ]


def test_the_command_prints_the_paper_average_after_the_table(tmp_path, monkeypatch, capsys):
    bench_dir = tmp_path / "bench"
    for key in [*SOURCES, "math"]:
        _bench(bench_dir, key)
    (bench_dir / "svamp_test.parquet").write_bytes((bench_dir / "math_test.parquet").read_bytes())
    table = {"gspo": {**HAND_TABLE["gspo"], **_result({"svamp": 0.0})}, "hacpo": HAND_TABLE["hacpo"]}
    (tmp_path / "out").mkdir()  # what evaluate() makes before its first checkpoint
    monkeypatch.setattr(ev, "evaluate", lambda checkpoints, benchmarks, out, *a, **kw: table)
    rc = ev.main(["--checkpoint", "gspo=/nowhere/a", "--checkpoint", "hacpo=/nowhere/b", "--bench-dir", str(bench_dir),
                  "--bench", f"svamp={bench_dir / 'svamp_test.parquet'}", "--out", str(tmp_path / "out")])
    assert rc == 0
    out = capsys.readouterr().out
    # the table's AVG counts the extra column; the paper's average does not
    assert "| hacpo | 0.600 | 0.700 | 0.900 | 0.200 | 0.500 | 0.350 | 0.250 | 1.000 | 0.562 |" in out
    assert out.index("| hacpo | 0.600") < out.index("| checkpoint | AVG |")
    assert "| gspo | .429 |\n| hacpo | .500 |\n" in out
