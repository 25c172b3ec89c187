"""One HACPO step of two agents at the presets' full layer shapes on one GPU: set-up, step and memory.

    python benchmarks/preset_shapes_step.py [--shapes Qwen3-0.6B-Base Llama-3.2-1B-Instruct]
        [--response-length 256] [--work DIR] [--timeout 900]
    python benchmarks/preset_shapes_step.py --tiny --response-length 16   # the same path on a CPU

No download: each agent is a random-weight model of a public config's shapes
(tests/fixtures/model_shapes/<name>/config.json: widths, depth, heads, head_dim, vocabulary,
tying) with the real tokenizer of its family (recipe_hacpo.real_tokenizers' cache; `make
tokenizers` fills it). The step is the preflight's train run (`preflight.train_overrides`: one
shared pool, bf16, the first agent with param/optimizer offload, the second with FSDP2's
`offload_policy`) with longer responses and gradient checkpointing. Random weights rarely end a
response early, so every response runs to `--response-length`: the step's cost is that of full
responses. `--tiny` keeps the tiny widths of `tiny_agents.REAL_ARCH_KIND_SPECS` (same
vocabulary, tying and tokenizer) for a CPU rehearsal.

Prints, per agent: parameters, and from the step's metrics the actor's GPU peak
(`perf/max_memory_allocated_gb`), the mean response length and the step's timings; then the run's
wall time from start to the step's end. Exit 1 when the run fails or logs no step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES_DIR = os.path.join(REPO, "tests", "fixtures", "model_shapes")
# the shape fields a public config gives and RealArchSpec holds
SHAPE_FIELDS = {"hidden_size": "hidden_size", "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
                "intermediate_size": "intermediate_size"}


def spec_for(shape_name: str, *, tiny: bool = False):
    """The RealArchSpec of a preset model's family, at the public config's shapes (`tiny`: the
    family's tiny widths). Raises ValueError naming the config when it is not a family here."""
    from recipe_hacpo.tiny_agents import REAL_ARCH_KIND_SPECS

    path = os.path.join(SHAPES_DIR, shape_name, "config.json")
    with open(path) as f:
        shape = json.load(f)
    tied = bool(shape.get("tie_word_embeddings", False))
    kind = {("qwen3", True): "qwen3-tied", ("qwen3", False): "qwen3-untied",
            ("llama", True): "llama3p2-tied"}.get((shape.get("model_type"), tied))
    if kind is None:
        raise ValueError(f"{path}: model_type {shape.get('model_type')!r} with tie_word_embeddings={tied} "
                         f"is none of this benchmark's families (qwen3 tied/untied, llama tied)")
    spec = REAL_ARCH_KIND_SPECS[kind]
    if spec.vocab_size != shape["vocab_size"]:
        raise ValueError(f"{path}: vocab_size {shape['vocab_size']} but {kind} has {spec.vocab_size}")
    if tiny:
        return spec
    return dataclasses.replace(spec, **{field: shape[key] for field, key in SHAPE_FIELDS.items()})


def build_agent_at(spec, out: str, seed: int = 0) -> int:
    """Random weights of `spec` in bf16 with its real tokenizer, saved to `out`; its parameter count.
    Built on the GPU when there is one (a 1B model's init on a CPU takes minutes)."""
    import torch

    from recipe_hacpo import real_tokenizers
    from recipe_hacpo.tiny_agents import build_real_arch_model, real_generation_config

    tokenizer = real_tokenizers.load_tokenizer(spec.tokenizer)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = build_real_arch_model(spec, tokenizer, seed)
    model = model.to(torch.bfloat16)
    model.generation_config = real_generation_config(spec, tokenizer)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def agent_name(shape_name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", shape_name.lower()).strip("_")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs=2, default=["Qwen3-0.6B-Base", "Llama-3.2-1B-Instruct"],
                    help=f"two folders of {os.path.relpath(SHAPES_DIR, REPO)}")
    ap.add_argument("--response-length", type=int, default=256)
    ap.add_argument("--tiny", action="store_true", help="the families' tiny widths (a CPU rehearsal)")
    ap.add_argument("--work", default=None, help="agents, logs and metrics (default: a new temporary folder)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for the training run")
    args = ap.parse_args(argv)

    import torch

    from recipe_hacpo import preflight

    specs = {agent_name(s): spec_for(s, tiny=args.tiny) for s in args.shapes}  # bad input fails here, first
    if preflight.repo_data_dir() is None:
        sys.exit("data/arith_add1_train.parquet not found: run from the repository root or set HACPO_DATA_DIR")
    work = args.work or tempfile.mkdtemp(prefix="hacpo_preset_shapes_")
    dirs = {}
    for name, spec in specs.items():
        dirs[name] = os.path.join(work, "agents", name)
        n_params = build_agent_at(spec, dirs[name])
        print(f"{name}: {n_params / 1e9:.3f} B parameters, vocabulary {spec.vocab_size}, "
              f"tied={spec.tie_word_embeddings}", flush=True)
    cuda = torch.cuda.is_available()
    overrides = preflight.train_overrides(dirs, work, cuda) + [
        "data.max_prompt_length=96", f"data.max_response_length={args.response_length}",
        "trainer.total_training_steps=1", "trainer.save_freq=-1", "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.model.enable_gradient_checkpointing=true"]
    t0 = time.monotonic()
    run = preflight.run_main(overrides, work, "S", args.timeout)
    wall = time.monotonic() - t0
    print(f"run: {'ok' if not run['why'] else run['why']} ({wall:.0f} s from start to end; log {run['log']})")
    if run["why"] or sorted(run["steps"]) != [1]:
        return 1
    step = run["steps"][1]
    for name in dirs:
        figures = {k.split(f"agent/{name}/", 1)[1]: v for k, v in step.items() if k.startswith(f"agent/{name}/")
                   and k.endswith(("perf/max_memory_allocated_gb", "response_length/mean", "timing_s/gen",
                                   "timing_s/update_actor", "rollout/log_prob_diff_mean"))}
        print(f"  {name}: " + ", ".join(f"{k} {v:.4g}" for k, v in sorted(figures.items())))
    peak = preflight.gpu_peak_from_metrics(run["steps"])
    print(f"  step {step.get('timing_s/step', float('nan')):.1f} s; actors' GPU peak together: "
          f"{'n/a (CPU)' if peak is None or not cuda else f'{peak:.2f} GiB'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
