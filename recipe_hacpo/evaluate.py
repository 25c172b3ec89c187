"""Evaluate each agent's checkpoint on the math benchmarks and write the paper's Table 1.

    python -m recipe_hacpo.evaluate \\
        --checkpoint hacpo_1.7b=outputs/<pair>_hacpo/checkpoints/global_step_58/qwen3_1p7b_base \\
        --checkpoint base_1.7b=/models/Qwen3-1.7B-Base \\
        --bench-dir data/paper --out eval/

`--bench-dir DIR` picks up `<name>_test.parquet` of the seven benchmarks as written by
`python -m recipe_hacpo.data.prepare --all-from RAW --out DIR`; `--bench NAME=FILE` adds or
replaces one (names: math500, math, gsm8k, aime25, amc23, minerva, olympiadbench; any other
name becomes an extra column).

Checkpoints (`--checkpoint NAME=PATH`, one table row each, in the order given; `--agents-from
[PREFIX=]DIR` adds a row for every agent of a trainer checkpoint, DIR being `global_step_N` or
the checkpoint root, whose latest step is taken):
  - a Hugging Face model dir (config.json + safetensors/bin weights), or a hub id already in
    the local Hugging Face cache;
  - a trainer checkpoint of one agent, `global_step_N/<agent>` or `global_step_N/<agent>/actor`:
    `actor/huggingface/` holds config and tokenizer (and full weights if the run saved them, which
    are then used as they are); otherwise the FSDP shards `actor/model_world_size_W_rank_R.pt`
    are merged into `<out>/models/NAME/`. Supported: FSDP2 (DTensor) shards on a 1-D device mesh,
    any W, and plain tensors when W = 1. Not supported: 2-D meshes (HSDP, tensor parallel) and
    FSDP1 flat shards — merge those with `python -m verl.model_merger merge --backend fsdp
    --local_dir .../actor --target_dir DIR` and pass DIR.

Metrics. A benchmark has P prompts; prompt i gets n samples with scores s_i1 .. s_in from
`reward.math_reward.compute_score` (1.0 correct, 0.0 not); a sample counts as correct when
s_ij >= 0.5, c_i is the number of correct samples of prompt i. For k <= n:

    avg@k  = 1/P sum_i  1/k sum_{j<=k} s_ij         mean score of the first k samples
    best@k = 1/P sum_i  max_{j<=k} s_ij             max over the first k samples, averaged over
                                                    prompts: the share of prompts solved at
                                                    least once in k tries
    pass@k = 1/P sum_i  1 - C(n - c_i, k) / C(n, k)  the unbiased estimator of Chen et al. (2021)
                                                    from n >= k samples (= best@k when n = k)

Defaults as in the paper: AIME25 best@30, every other benchmark avg@1. `--metric BENCH=SPEC`
(SPEC avg@k | best@k | pass@k) changes one; `--samples BENCH=N` draws N >= k samples.
Sampling: one sample per prompt is decoded greedily (unless `--sample-single`), several are
drawn at `--temperature` (1.0, the training temperature) and `--top-p` (1.0).

Backends: `vllm` (GPU; vLLM is imported only when this backend runs) and `hf` (Hugging Face
`generate`, CPU or GPU); `auto` takes vLLM when it is installed and a GPU is visible.
With vLLM every checkpoint runs in its own process (its engine and GPU memory are gone when
the process ends), and checkpoints are spread over the GPUs: one at a time per group of
`--tensor-parallel-size` GPUs of `--gpus` (default: every visible GPU).

Printed after the table: each checkpoint's AVG over the seven benchmarks alone, written as the
paper writes its averages (.493), for setting beside docs/REPRODUCE.md's expected numbers.

Output in `--out`: `table.md` and `table.csv` (rows: checkpoints; columns: MATH-500, MATH,
GSM8K, AIME25, AMC23, Minerva, OlympiadBench — those evaluated, in this order — then extra
benchmarks, then AVG, the unweighted mean over the row's benchmarks), `metrics.json` (every
metric, prompt and sample count per checkpoint and benchmark) and
`samples/NAME/BENCH.jsonl` (every response with its score).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time
from typing import Callable, Sequence

from recipe_hacpo.atomic_io import atomic_write_json
from recipe_hacpo.evaluation import EvalError
from recipe_hacpo.evaluation.benchmarks import (
    MAIN_TABLE_MAX_NEW_TOKENS,
    Benchmark,
    all_metrics,
    build_benchmarks,
    load_benchmark,
    parse_pairs,
)
from recipe_hacpo.evaluation.checkpoints import path_name, agent_checkpoints, resolve_checkpoint, trainer_step_dir
from recipe_hacpo.training.run_identity import describe_checkpoint
from recipe_hacpo.evaluation.generators import GenOptions, gpu_groups, make_generator, pick_backend
from recipe_hacpo.evaluation.tables import format_paper_average, write_tables

# --------------------------------------------------------------------------- evaluation


def _load_compute_score(reward: str | None = None) -> Callable:
    """The reward that scores the responses: `reward` = "PATH[:NAME]" names a file and function as
    verl's `reward.custom_reward_function` does (NAME default compute_score); None: the package's
    math reward. A reward that cannot be loaded is one EvalError line."""
    if reward is None:
        from recipe_hacpo.reward.math_reward import compute_score

        return compute_score
    from omegaconf import OmegaConf

    from recipe_hacpo.hacpo_settings import ConfigError
    from recipe_hacpo.training.scoring import load_reward_fn

    path, name = reward.rsplit(":", 1) if ":" in os.path.basename(reward) else (reward, "compute_score")
    cfg = OmegaConf.create({"reward": {"custom_reward_function": {"path": path, "name": name}}})
    try:
        return load_reward_fn(cfg)
    except ConfigError as exc:
        raise EvalError(f"--reward {reward}: {exc}") from None


def score_responses(rows: Sequence[dict], responses: Sequence[Sequence[str]], compute_score: Callable) -> list[list[float]]:
    scores = []
    for row, texts in zip(rows, responses):
        prompt_scores = []
        for text in texts:
            result = compute_score(
                data_source=row["data_source"], solution_str=text, ground_truth=row["ground_truth"], extra_info=row["extra_info"]
            )
            prompt_scores.append(float(result["score"] if isinstance(result, dict) else result))
        scores.append(prompt_scores)
    return scores


def evaluate(
    checkpoints: Sequence[tuple[str, str]],
    benchmarks: Sequence[Benchmark],
    out_dir: str,
    opts: GenOptions,
    limit: int | None = None,
    log: Callable[[str], None] = print,
    gpus: str | None = None,
    isolate: bool | None = None,
    reward: str | None = None,
) -> dict:
    """Generate, score and summarise; returns {checkpoint: {bench key: metrics}} (also in metrics.json).

    With `isolate` (default: for the vllm backend) every checkpoint is evaluated in its own
    process, so its vLLM engine and GPU memory are gone when the next one starts, and up to
    one checkpoint per GPU group (`gpu_groups`) runs at a time. Without it, checkpoints run
    one after another in this process. `reward`: "PATH[:NAME]" of the run's own reward function
    (`_load_compute_score`), checked here before any checkpoint is merged.
    """
    backend = pick_backend(opts.backend)
    compute_score = _load_compute_score(reward)
    data = {b.key: load_benchmark(b.path, limit) for b in benchmarks}
    results: dict[str, dict] = {}
    os.makedirs(out_dir, exist_ok=True)
    # trainer checkpoints are merged here, once, before any generation
    jobs = [(name, resolve_checkpoint(path, os.path.join(out_dir, "models", path_name(name)))) for name, path in checkpoints]
    if isolate is None:
        isolate = backend == "vllm"

    def done(name: str, per_bench: dict) -> None:
        results[name] = per_bench
        # kept current, so an interrupted run keeps what it finished
        atomic_write_json(os.path.join(out_dir, "metrics.json"), results)

    if isolate:
        groups = gpu_groups(gpus, opts.tensor_parallel_size) or [None]
        _run_isolated(jobs, groups, (benchmarks, data, out_dir, opts, backend, reward), done, log)
        # table order follows the command line, not completion order
        ordered = {name: results[name] for name, _ in jobs}
        results.clear()
        results.update(ordered)
    else:
        for name, model_dir in jobs:
            done(name, evaluate_checkpoint(name, model_dir, benchmarks, data, out_dir, opts, backend, compute_score, log))
    atomic_write_json(os.path.join(out_dir, "metrics.json"), results)
    return results


def evaluate_checkpoint(
    name: str,
    model_dir: str,
    benchmarks: Sequence[Benchmark],
    data: dict,
    out_dir: str,
    opts: GenOptions,
    backend: str,
    compute_score: Callable,
    log: Callable[[str], None] = print,
) -> dict:
    """One checkpoint on every benchmark: {bench key: metrics}; its samples go to out_dir/samples."""
    log(f"[{name}] {model_dir} ({backend})")
    generator = make_generator(backend, model_dir, opts)
    results: dict[str, dict] = {}
    try:
        for bench in benchmarks:
            rows = data[bench.key]
            greedy = bench.n == 1 and not opts.sample_single
            temperature = 0.0 if greedy else opts.temperature
            if temperature <= 0 and bench.n > 1:
                raise EvalError(f"{bench.key}: {bench.n} samples per prompt need --temperature > 0")
            start = time.monotonic()
            responses = generator.generate([r["messages"] for r in rows], bench.n, temperature, opts.seed)
            if len(responses) != len(rows) or any(len(r) != bench.n for r in responses):
                raise EvalError(f"{bench.key}: the generator returned the wrong number of responses")
            scores = score_responses(rows, responses, compute_score)
            metrics = all_metrics(scores, bench.metric)
            results[bench.key] = {
                "metric": str(bench.metric),
                "value": metrics[str(bench.metric)],
                "metrics": metrics,
                "prompts": len(rows),
                "samples_per_prompt": bench.n,
                "temperature": temperature,
                "file": bench.path,
            }
            _write_samples(
                os.path.join(out_dir, "samples", path_name(name), f"{path_name(bench.key)}.jsonl"), rows, responses, scores
            )
            log(f"[{name}] {bench.label}: {bench.metric} = {metrics[str(bench.metric)]:.4f} ({len(rows)} prompts, {time.monotonic() - start:.0f} s)")
    finally:
        generator.close()
    return results


def _checkpoint_process(name, model_dir, shared, queue) -> None:
    """Body of one checkpoint's process: evaluate, send (name, ok, result or error line), exit."""
    benchmarks, data, out_dir, opts, backend, reward = shared
    try:
        result = evaluate_checkpoint(name, model_dir, benchmarks, data, out_dir, opts, backend, _load_compute_score(reward),
                                     lambda msg: print(msg, flush=True))
        queue.put((name, True, result))
    except BaseException as e:  # reported by the parent as one line naming the checkpoint
        first = (str(e).strip().splitlines() or [""])[0]
        queue.put((name, False, f"{type(e).__name__}: {first}"))


# how often the parent looks for a checkpoint process that died without reporting (seconds)
_POLL_S = 2.0


def _run_isolated(jobs, groups, shared, done, log) -> None:
    """Run `_checkpoint_process` per job, at most one per GPU group at a time (spawned, so no
    CUDA state is inherited); CUDA_VISIBLE_DEVICES is the job's group."""
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")
    # by reference to the importable module, also when this file runs as `python -m` (__main__)
    target = importlib.import_module("recipe_hacpo.evaluate")._checkpoint_process
    results = ctx.Queue()
    pending, free = list(jobs), list(groups)
    running: dict[str, tuple] = {}
    try:
        while pending or running:
            while pending and free:
                (name, model_dir), group = pending.pop(0), free.pop(0)
                saved = os.environ.get("CUDA_VISIBLE_DEVICES")
                if group is not None:
                    os.environ["CUDA_VISIBLE_DEVICES"] = group
                    log(f"[{name}] on GPU(s) {group}")
                try:
                    proc = ctx.Process(target=target, args=(name, model_dir, shared, results), daemon=False)
                    proc.start()
                finally:
                    if saved is None:
                        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                    else:
                        os.environ["CUDA_VISIBLE_DEVICES"] = saved
                running[name] = (proc, group)
            try:
                name, ok, payload = results.get(timeout=_POLL_S)
            except queue_mod.Empty:
                dead = [(n, p.exitcode) for n, (p, _) in running.items() if not p.is_alive()]
                if dead:
                    n, code = dead[0]
                    raise EvalError(f"checkpoint {n}: its evaluation process exited with code {code} without a result")
                continue
            proc, group = running.pop(name)
            proc.join()
            free.append(group)
            if not ok:
                raise EvalError(f"checkpoint {name}: {payload}")
            done(name, payload)
    finally:
        for proc, _ in running.values():
            proc.terminate()
            proc.join()


def _write_samples(path: str, rows, responses, scores) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i, (row, texts, values) in enumerate(zip(rows, responses, scores)):
            record = {
                "index": i,
                "data_source": row["data_source"],
                "ground_truth": row["ground_truth"],
                "prompt": row["messages"][-1]["content"],
                "responses": list(texts),
                "scores": values,
            }
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recipe_hacpo.evaluate",
        description="Evaluate checkpoints on math benchmarks; write Table 1 (markdown + CSV).",
    )
    parser.add_argument("--checkpoint", action="append", metavar="NAME=PATH", help="a table row (repeat)")
    parser.add_argument(
        "--agents-from", action="append", metavar="[PREFIX=]DIR",
        help="one row per agent of a trainer checkpoint (global_step_N, or the root: latest step)",
    )
    parser.add_argument("--bench", action="append", metavar="NAME=FILE", help="a benchmark parquet file (repeat)")
    parser.add_argument("--bench-dir", help="pick up <benchmark>_test.parquet files from recipe_hacpo.data.prepare")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--metric", action="append", metavar="BENCH=SPEC", help="avg@k | best@k | pass@k (default: aime25 best@30, else avg@1)")
    parser.add_argument("--samples", action="append", metavar="BENCH=N", help="samples per prompt (default: the metric's k)")
    parser.add_argument("--backend", default="auto", help="auto | vllm | hf")
    parser.add_argument("--temperature", type=float, default=1.0, help="when sampling several responses")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--sample-single", action="store_true", help="sample (not greedy) when one response per prompt")
    parser.add_argument(
        "--max-new-tokens", type=int, default=MAIN_TABLE_MAX_NEW_TOKENS,
        help=f"generation limit per response (default {MAIN_TABLE_MAX_NEW_TOKENS}, the paper's main tables)",
    )
    parser.add_argument("--max-prompt-length", type=int, default=2048, help="vLLM context = this + --max-new-tokens")
    parser.add_argument("--limit", type=int, help="first N prompts of every benchmark (smoke tests)")
    parser.add_argument("--batch-size", type=int, default=16, help="hf: prompts per generate call")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU) | bfloat16 | float16 | float32")
    parser.add_argument("--device", help="hf: cpu | cuda[:i] (default: cuda when available)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="vllm")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="vllm")
    parser.add_argument(
        "--isolate", action=argparse.BooleanOptionalAction, default=None,
        help="evaluate every checkpoint in its own process (default: yes with vllm, no with hf)",
    )
    parser.add_argument(
        "--gpus", metavar="IDS",
        help="vllm: GPU ids to spread checkpoints over, e.g. 0,1,2,3: one checkpoint per group of "
        "--tensor-parallel-size GPUs at a time, each in its own process (default: every visible GPU)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--reward", metavar="PATH[:NAME]",
        help="the reward function that scores responses, as the run's reward.custom_reward_function "
        "(NAME default compute_score; default: the package's math reward)",
    )
    parser.add_argument(
        "--chat-template-kwargs", default="{}", metavar="JSON",
        help='extra chat template arguments, as in training (e.g. \'{"enable_thinking": false}\')',
    )
    parser.add_argument("--percent", action="store_true", help="markdown values as percentages")
    args = parser.parse_args(argv)
    try:
        checkpoints = parse_pairs(args.checkpoint, "--checkpoint")
        for spec in args.agents_from or []:
            checkpoints += agent_checkpoints(spec)
        if not checkpoints:
            raise EvalError("nothing to evaluate: give --checkpoint NAME=PATH or --agents-from DIR")
        names = [n for n, _ in checkpoints]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup:
            raise EvalError(f"--checkpoint {dup}: name given twice")
        if args.limit is not None and args.limit < 1:
            raise EvalError("--limit must be >= 1")
        if args.max_new_tokens < 1 or args.batch_size < 1:
            raise EvalError("--max-new-tokens and --batch-size must be >= 1")
        # first, what trained each trainer checkpoint to be evaluated (method, agents, step)
        for step_dir in dict.fromkeys(filter(None, (trainer_step_dir(path) for _, path in checkpoints))):
            print(describe_checkpoint(step_dir), flush=True)
        benchmarks = build_benchmarks(args.bench, args.bench_dir, args.metric, args.samples)
        try:
            template_kwargs = json.loads(args.chat_template_kwargs)
        except json.JSONDecodeError as e:
            raise EvalError(f"--chat-template-kwargs: not JSON ({e.msg})") from None
        if not isinstance(template_kwargs, dict):
            raise EvalError("--chat-template-kwargs: expected a JSON object")
        opts = GenOptions(
            backend=args.backend,
            temperature=args.temperature,
            top_p=args.top_p,
            max_new_tokens=args.max_new_tokens,
            max_prompt_length=args.max_prompt_length,
            sample_single=args.sample_single,
            batch_size=args.batch_size,
            dtype=args.dtype,
            device=args.device,
            tensor_parallel_size=args.tensor_parallel_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            seed=args.seed,
            chat_template_kwargs=tuple(template_kwargs.items()),
        )
        results = evaluate(checkpoints, benchmarks, args.out, opts, limit=args.limit, gpus=args.gpus, isolate=args.isolate,
                           reward=args.reward)
    except EvalError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    md_path, csv_path = write_tables(results, benchmarks, args.out, args.percent)
    with open(md_path) as f:
        print(f.read(), end="")
    print()
    print(format_paper_average(results), end="")
    print(f"wrote {md_path}, {csv_path}, {os.path.join(args.out, 'metrics.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
