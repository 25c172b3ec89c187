"""How long the step waits on the rollout exchange, serial (as before) and off the critical path.

    python benchmarks/exchange_scale.py                     # N = 2..6, 128 rows, ~2k-token responses
    python benchmarks/exchange_scale.py --paper --agents 2 3 # the paper's batch: 128 prompts x 8, ~4k tokens

Synthetic rollout batches from real text (this repository's docs and code, plus LaTeX, CJK, runs of
spaces and typed special-token strings) in the real Qwen3 and Llama-3 tokenizers
(`recipe_hacpo.real_tokenizers`, fetched with npm into a cache). Agents alternate Qwen3 / Llama-3, so
pairs of one tokenizer take the shared fast path and the others re-tokenize. Every agent of one
tokenizer gets the same rows (building them costs as much as converting them); nothing is cached
across sources, so that changes no timing.

A step is simulated on the driver, from the moment generate returns every agent's rollouts:

    before   score decodes each agent's responses, serially; `--window-s` of GPU phases (old
             log-probs) in which the driver idles; then every (source, learner) pair is converted
             serially (`RowConverter.convert`), as the trainer did with trainer.exchange_workers=0
    after    the trainer's `ConversionJobs`: decoding and conversions start at once on background
             threads; score waits for the text; the same window passes (a sleep: the driver is free);
             the exchange phase joins every pair and attaches the late per-row fields

and prints, per N: the response tokens converted per step (summed over re-tokenizing pairs), the
driver's seconds on the critical path (decode + exchange before; the waits after), M tokens/s (tokens
converted / seconds from generate's return until the last pair is ready, with no window), and
whether every learner batch of `after` equals `before`'s bit for bit.
"""

from __future__ import annotations

import argparse
import glob
import os
import platform
import sys
import time

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from verl import DataProto  # noqa: E402

from recipe_hacpo import batch_keys as K  # noqa: E402
from recipe_hacpo.exchange.retokenize import RowConverter, pack_rows  # noqa: E402
from recipe_hacpo.exchange.jobs import ConversionJobs  # noqa: E402
from recipe_hacpo.training.scoring import decode_responses  # noqa: E402

KINDS = ("qwen3", "llama3")
HARD = [
    "\\[ \\int_0^1 x^2 \\, dx = \\frac{1}{3} \\]", "<think>\nLet me check: 12 × 7 = 84.\n</think>",
    "答案是 42。  ", "café  naïve   Ångström", "<|im_end|> and <|eot_id|> typed as text", "x = 2 , so .",
]


def corpus() -> str:
    """Real text: this repository's docs, README and Python sources, with hard pieces between files."""
    paths = sorted(glob.glob(os.path.join(REPO, "docs", "*.md"))) + [os.path.join(REPO, "README.md")]
    paths += sorted(glob.glob(os.path.join(REPO, "recipe_hacpo", "*.py")))
    parts = []
    for i, path in enumerate(paths):
        with open(path, encoding="utf-8") as f:
            parts.append(f.read())
        parts.append("\n" + HARD[i % len(HARD)] + "\n")
    return "".join(parts)


def windows(text: str, count: int, chars: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    doubled = text * (1 + chars // max(1, len(text)) + 1)
    starts = rng.integers(0, len(text), size=count)
    return [doubled[s : s + chars] for s in starts]


def rollouts(tok, eos_id: int, *, prompts: int, n: int, prompt_tokens: int, response_tokens: int, seed: int) -> DataProto:
    """One agent's rollout batch in verl's layout: `prompts` prompts x `n` responses of real text,
    lengths uniform in [R/2, R], three in four finished on EOS, the rest cut at R."""
    text = corpus()
    questions = windows(text, prompts, 4 * prompt_tokens, seed)
    rows = prompts * n
    rng = np.random.default_rng(seed + 1)
    lengths = rng.integers(response_tokens // 2, response_tokens + 1, size=rows)
    finished = rng.random(rows) < 0.75
    answers = windows(text, rows, 5 * response_tokens, seed + 2)
    encoded = tok(answers, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    responses = []
    for ids, length, fin in zip(encoded, lengths, finished):
        ids = list(ids[: int(length) - 1]) + [eos_id] if fin else list(ids[:response_tokens])
        responses.append(ids)
    raw = np.empty(rows, dtype=object)
    prompt_ids = []
    for q in range(prompts):
        messages = [{"role": "system", "content": "Reason step by step."}, {"role": "user", "content": questions[q]}]
        ids = list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False))
        for _ in range(n):
            raw[len(prompt_ids)] = messages
            prompt_ids.append(ids)
    width = max(map(len, prompt_ids))
    layout = pack_rows(prompt_ids, responses, pad_id=tok.pad_token_id, prompt_width=width, response_width=response_tokens)
    uid = np.array([f"prompt{i // n}" for i in range(rows)], dtype=object)
    return DataProto.from_dict(tensors=layout, non_tensors={"uid": uid, "raw_prompt": raw})


def late_fields(batch: DataProto) -> None:
    """What score and old log-probs attach before the exchange (1-D, per row)."""
    rows = len(batch)
    batch.batch[K.REWARD] = torch.arange(rows, dtype=torch.float32) % 2
    batch.batch[K.SOURCE_LOG_PROB_MEAN] = -torch.arange(rows, dtype=torch.float32) / rows
    batch.batch[K.SOURCE_RESPONSE_LENGTH] = batch.batch["response_mask"].sum(-1).float()


class Setup:
    """N agents (alternating kinds), their rollouts and every (source, learner) converter; a smaller
    N takes the first agents of a larger one (tokenizers and converters are built once)."""

    def __init__(self, agents: int, base: dict, prompt_width: int, response_width: int) -> None:
        from recipe_hacpo.real_tokenizers import load_tokenizer

        self.names = [f"{KINDS[i % 2]}_{i}" for i in range(agents)]
        self.kind = {name: KINDS[i % 2] for i, name in enumerate(self.names)}
        # every agent holds its own tokenizer object, as AgentRuntime does
        self.tokenizer = {name: load_tokenizer(self.kind[name]) for name in self.names}
        self.base = base
        self.all_converters = {
            (s, l): RowConverter(self.tokenizer[s], self.tokenizer[l], max_prompt_length=prompt_width,
                                    max_response_length=response_width)
            for s in self.names for l in self.names if s != l
        }
        self.use(agents)

    def use(self, agents: int) -> "Setup":
        self.names = [f"{KINDS[i % 2]}_{i}" for i in range(agents)]
        self.converters = {(s, l): ex for (s, l), ex in self.all_converters.items() if s in self.names and l in self.names}
        return self

    def fresh_rollouts(self) -> dict[str, DataProto]:
        """Each agent's rollouts as generate returns them (its own DataProto over the kind's rows).
        The converters' prompt caches are emptied: a step's prompts are new to them."""
        for ex in self.converters.values():
            ex._prompt_cache.clear()
        out = {}
        for name in self.names:
            b = self.base[self.kind[name]]
            out[name] = DataProto.from_dict(tensors=dict(b.batch.items()), non_tensors=dict(b.non_tensor_batch))
        return out

    def tokens_converted(self) -> int:
        """Response tokens of the source rows of every re-tokenizing pair (what crosses tokenizers)."""
        return sum(int(self.base[self.kind[s]].batch["response_mask"].sum())
                   for (s, l), ex in self.converters.items() if not ex.shared)


def step_before(setup: Setup, window_s: float) -> tuple[float, float, dict]:
    """The serial path: (critical-path seconds, conversion seconds, learner parts)."""
    rollouts_ = setup.fresh_rollouts()
    t0 = time.perf_counter()
    for name, batch in rollouts_.items():  # score: decode each agent's responses, serially
        batch.non_tensor_batch[K.RESPONSE_TEXT] = np.array(decode_responses(batch, setup.tokenizer[name]), dtype=object)
        late_fields(batch)
    decode_s = time.perf_counter() - t0
    time.sleep(window_s)
    t1 = time.perf_counter()
    parts = {(s, l): setup.converters[(s, l)].convert(rollouts_[s]) for l in setup.names for s in setup.names if s != l}
    exchange_s = time.perf_counter() - t1
    return decode_s + exchange_s, decode_s + exchange_s, parts


def step_after(setup: Setup, window_s: float, workers: int) -> tuple[tuple[float, float], float, dict]:
    """The trainer's ConversionJobs: ((score's wait, exchange phase) seconds, seconds until every pair
    was ready, parts)."""
    jobs = ConversionJobs(dict(setup.converters), decode_responses, workers)
    try:
        rollouts_ = setup.fresh_rollouts()
        jobs.begin_step(1)
        t0 = time.perf_counter()
        for name, batch in rollouts_.items():
            jobs.start(name, batch, [l for l in setup.names if l != name], setup.tokenizer[name])
        for name, batch in rollouts_.items():  # score waits for the text
            batch.non_tensor_batch[K.RESPONSE_TEXT] = np.array(jobs.texts(name), dtype=object)
            late_fields(batch)
        score_s = time.perf_counter() - t0
        time.sleep(window_s)
        t1 = time.perf_counter()
        parts = {(s, l): jobs.convert(s, l, rollouts_[s]) for l in setup.names for s in setup.names if s != l}
        jobs.check()
        done = time.perf_counter()
        exchange_s = done - t1
        ready_s = (done - t0) - window_s if window_s == 0 else float("nan")
        return (score_s, exchange_s), ready_s, parts
    finally:
        jobs.close()


def identical(a: dict, b: dict) -> bool:
    for key, x in a.items():
        y = b[key]
        if list(x.batch.keys()) != list(y.batch.keys()):
            return False
        if any(not torch.equal(x.batch[k], y.batch[k]) for k in x.batch.keys()):
            return False
        if any(x.non_tensor_batch[k].tolist() != y.non_tensor_batch[k].tolist() for k in x.non_tensor_batch):
            return False
    return True


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, nargs="+", default=[2, 3, 4, 5, 6], help="N values (agents alternate kinds)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="responses per prompt")
    p.add_argument("--prompt-tokens", type=int, default=150, help="about this many tokens of question text")
    p.add_argument("--response-tokens", type=int, default=2048, help="R: responses are R/2..R tokens")
    p.add_argument("--paper", action="store_true", help="the paper's batch: 128 prompts x 8 responses of 2.3k..4.6k tokens")
    p.add_argument("--window-s", type=float, nargs="+", default=[0.0, 5.0],
                   help="seconds of GPU phases (old log-probs) between score and exchange; 0 = no overlap")
    p.add_argument("--workers", type=int, default=0, help="threads of the jobs (0: one per agent, the trainer's default)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.paper:
        args.prompts, args.n, args.response_tokens = 128, 8, 4608
    if min(args.agents) < 2 or args.prompts < 1 or args.n < 1 or args.response_tokens < 2 or args.prompt_tokens < 1:
        p.error("need --agents >= 2 and positive sizes")

    from recipe_hacpo.real_tokenizers import load_tokenizer

    start = time.perf_counter()
    base = {}
    for i, kind in enumerate(KINDS):
        tok = load_tokenizer(kind)
        base[kind] = rollouts(tok, tok.eos_token_id, prompts=args.prompts, n=args.n, prompt_tokens=args.prompt_tokens,
                              response_tokens=args.response_tokens, seed=args.seed + 10 * i)
    rows = args.prompts * args.n
    mean_tokens = {k: float(b.batch["response_mask"].sum(-1).float().mean()) for k, b in base.items()}
    print(f"exchange_scale: {rows} rows ({args.prompts} prompts x {args.n}), responses {args.response_tokens // 2}.."
          f"{args.response_tokens} tokens (mean {mean_tokens['qwen3']:.0f} Qwen3 / {mean_tokens['llama3']:.0f} Llama-3 "
          f"tokens), prompts ~{args.prompt_tokens} tokens of text; built in {time.perf_counter() - start:.0f} s")
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}; "
          f"TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM', '(unset)')}; torch threads "
          f"{torch.get_num_threads()}")
    windows_s = sorted(set(args.window_s))
    header = ("| N | pairs re-tokenized / shared | M tokens converted | before: critical s | before M tok/s | "
              "after: ready s (no window) | after M tok/s | " + " | ".join(f"after: critical s (score + exchange), window {w:g} s"
                                                                        for w in windows_s) + " | identical |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    everyone = Setup(max(args.agents), base, prompt_width=4 * args.prompt_tokens + 256,
                     response_width=args.response_tokens + args.response_tokens // 4)
    for agents in args.agents:
        setup = everyone.use(agents)
        workers = args.workers or agents
        tokens = setup.tokens_converted()
        retok = sum(not ex.shared for ex in setup.converters.values())
        before_s, _, serial = step_before(setup, 0.0)
        after = {}
        same = True
        for w in windows_s:
            critical, ready, parts = step_after(setup, w, workers)
            after[w] = (critical, ready)
            same = same and identical(serial, parts)
            del parts
        ready0 = after[0.0][1] if 0.0 in after else float("nan")
        cells = [f"{agents}", f"{retok} / {len(setup.converters) - retok}", f"{tokens / 1e6:.2f}", f"{before_s:.2f}",
                 f"{tokens / 1e6 / before_s:.2f}", f"{ready0:.2f}", f"{tokens / 1e6 / ready0:.2f}"]
        cells += [f"{sum(after[w][0]):.2f} ({after[w][0][0]:.2f} + {after[w][0][1]:.2f})" for w in windows_s]
        cells += ["yes" if same else "NO"]
        print("| " + " | ".join(cells) + " |", flush=True)
        if not same:
            raise SystemExit(f"N={agents}: the overlapped learner batches differ from the serial ones")
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
