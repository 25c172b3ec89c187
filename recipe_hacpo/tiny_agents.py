"""Tiny heterogeneous agents built offline, saved as Hugging Face checkpoint directories.

Each agent is a directory that verl loads through `actor_rollout_ref.model.path`
(`AutoConfig` / `AutoTokenizer` / `AutoModelForCausalLM` / `GenerationConfig`
`.from_pretrained(dir)`). Nothing is downloaded: tokenizers are assembled with the
`tokenizers` library and models are random-initialised from a seed.

Two genuinely different tokenizers exist so that cross-tokenizer exchange is exercised:

- "char": one token per ASCII character (byte-level, no merges), ChatML chat template
  (`<|im_start|>role\n...<|im_end|>`) with `<|im_end|>` as EOS, as in Qwen2;
- "pair": digit runs grouped in pairs (`0123` -> `01`, `23`), every other character its byte
  token(s), Llama-3-style chat template (`<|start_header_id|>role<|end_header_id|>`) with
  `<|eot_id|>` as EOS.

Both are byte-level and lossless on NFC text, so any text one of them decodes the other
encodes back exactly; their special-token strings and ids differ.

A second family (`REAL_ARCH_KINDS`) has the architectures the presets train, at small sizes,
with the real Qwen3 and Llama-3 tokenizers (`recipe_hacpo.real_tokenizers`, fetched into a cache):

- "qwen3-tied" / "qwen3-untied": Qwen3ForCausalLM (q/k RMS norms, an explicit head_dim that is
  not hidden / heads, rope_theta 1e6, GQA) with the embedding tied to the output layer as in
  Qwen3-0.6B..4B, or untied as in Qwen3-8B; vocabulary 151,936 ids, more than the tokenizer's
  151,669, as in the real configs;
- "llama3p2-tied": LlamaForCausalLM as Llama-3.2-1B/3B (tied, GQA, rope_theta 500000 with
  Llama-3's `rope_scaling`), 128,256 ids.

Their head size is 32, which vLLM's CPU attention accepts, so both rollout paths can serve them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import string
from typing import Sequence

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from recipe_hacpo import real_tokenizers
from recipe_hacpo.atomic_io import replace_dir, staging_dir

SPEC_FILE = "hacpo_tiny_agent.json"
"""Marker written last into an agent directory; its content decides whether a rebuild is needed."""

_SPEC_VERSION = 2
"""Bump when the builders change in a way that makes old directories stale."""

MAX_POSITIONS = 2048

# ---------------------------------------------------------------------------------------
# tokenizers
# ---------------------------------------------------------------------------------------

# Qwen2's pre-tokenisation split: letters runs, single digits, punctuation runs, whitespace.
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML like Qwen2 (verl picks its Qwen continuous-token builder for model_type "qwen2",
# which looks up `<|im_end|>`); bos exists but the template does not render it, as in Qwen.
CHAR_SPECIALS = {
    "unk": "<|unk|>",
    "pad": "<|endoftext|>",
    "bos": "<|bos|>",
    "eos": "<|im_end|>",
    "extra": ["<|im_start|>"],
}

CHAR_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

PAIR_SPECIALS = {
    "unk": "<|unk|>",
    "pad": "<|finetune_pad|>",
    "bos": "<|begin_of_text|>",
    "eos": "<|eot_id|>",
    "extra": ["<|start_header_id|>", "<|end_header_id|>"],
}

PAIR_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def _special_list(specials: dict) -> list[str]:
    """Special tokens in id order (they occupy the first ids of the vocabulary)."""
    return [specials["unk"], specials["pad"], specials["bos"], specials["eos"], *specials["extra"]]


def _wrap(tok: Tokenizer, specials: dict, chat_template: str) -> PreTrainedTokenizerFast:
    """Wrap a raw `tokenizers.Tokenizer` with its special tokens and chat template.

    `clean_up_tokenization_spaces=False` matters: the default clean-up rewrites " ." to "."
    on decode, which would break exact text round trips.
    """
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=specials["unk"],
        pad_token=specials["pad"],
        bos_token=specials["bos"],
        eos_token=specials["eos"],
        additional_special_tokens=list(specials["extra"]),
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITIONS,
    )


def _byte_level_bpe(specials: dict, split_pattern: str, merges: Sequence[tuple[str, str]] = ()) -> Tokenizer:
    """Byte-level BPE over the 256 byte symbols, plus `merges`; lossless for any UTF-8 text.

    The split regex isolates the pieces BPE may merge inside, so it alone fixes where tokens
    can span several characters. Special tokens take the first ids.
    """
    ordered = _special_list(specials) + sorted(pre_tokenizers.ByteLevel.alphabet())
    ordered += ["".join(m) for m in merges]
    vocab = {t: i for i, t in enumerate(ordered)}
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=list(merges), continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split_pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(_special_list(specials))
    return tok


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: one id per ASCII character (byte-level BPE without merges).

    Digits, operators, letters and LaTeX punctuation are one token each; any other text still
    round-trips exactly as several byte tokens, so nothing is ever unknown.

    Laid out exactly like Qwen2's pipeline (NFC, Qwen split regex, ByteLevel, BPE):
    `AutoTokenizer` forces `Qwen2Tokenizer` for `model_type == "qwen2"` and rebuilds that
    pipeline around the saved vocabulary, so any other layout would change after a reload.
    """
    return _wrap(_byte_level_bpe(CHAR_SPECIALS, QWEN2_SPLIT_REGEX), CHAR_SPECIALS, CHAR_CHAT_TEMPLATE)


def build_pair_tokenizer() -> PreTrainedTokenizerFast:
    """Digit-pair tokenizer: digit runs split left to right into pairs (`0123` -> `01`,`23`,
    `012` -> `01`,`2`); every other character is its byte token(s). Also lossless."""
    pairs = [(a, b) for a in string.digits for b in string.digits]
    tok = _byte_level_bpe(PAIR_SPECIALS, r"[0-9][0-9]|[\s\S]", merges=pairs)
    return _wrap(tok, PAIR_SPECIALS, PAIR_CHAT_TEMPLATE)


TOKENIZER_BUILDERS = {"char": build_char_tokenizer, "pair": build_pair_tokenizer}

# ---------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    """Everything that defines a tiny agent; serialised into `SPEC_FILE`."""

    arch: str  # "qwen2" | "llama"
    tokenizer: str  # key of TOKENIZER_BUILDERS
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    tie_word_embeddings: bool


AGENT_KINDS: dict[str, TinyModelSpec] = {
    # Small Qwen-like models tie embeddings (as Qwen2.5-0.5B does); the Llama-like one does not.
    "qwen2-char-small": TinyModelSpec("qwen2", "char", 64, 2, 4, 2, 128, True),
    "qwen2-char-medium": TinyModelSpec("qwen2", "char", 96, 3, 4, 2, 192, True),
    "llama-pair-medium": TinyModelSpec("llama", "pair", 96, 3, 4, 2, 192, False),
    # Head size 32 (hidden / heads): the smallest head size vLLM's CPU attention kernel accepts
    # (16 and 24, those of the kinds above, are refused). Used by the vLLM test tier.
    "qwen2-char-h32": TinyModelSpec("qwen2", "char", 64, 2, 2, 1, 128, True),
    "llama-pair-h32": TinyModelSpec("llama", "pair", 96, 2, 3, 1, 192, False),
    "qwen2-char-h32-medium": TinyModelSpec("qwen2", "char", 128, 2, 4, 2, 256, True),
    # multi-head attention (as many KV heads as heads), untied: a cell of the vLLM tier's kind matrix
    "llama-pair-h32-mha": TinyModelSpec("llama", "pair", 64, 2, 2, 2, 128, False),
}

# the agents of the demo, the hf-backed tests and the benchmark (every shipped warm start)
DEFAULT_KINDS = ("qwen2-char-small", "qwen2-char-medium", "llama-pair-medium")
# agents whose head size vLLM's CPU attention supports (`rollout.name=vllm` on CPU)
VLLM_CPU_KINDS = ("qwen2-char-h32", "llama-pair-h32", "qwen2-char-h32-medium", "llama-pair-h32-mha")

DEFAULT_SEEDS = {
    "qwen2-char-small": 0,
    "qwen2-char-medium": 1,
    "llama-pair-medium": 2,
    "qwen2-char-h32": 3,
    "llama-pair-h32": 4,
    "qwen2-char-h32-medium": 5,
    "llama-pair-h32-mha": 9,
}


@dataclasses.dataclass(frozen=True)
class RealArchSpec:
    """A tiny agent of a preset's architecture with a real tokenizer; serialised into `SPEC_FILE`.

    Every architecture field of the public config is kept (explicit head_dim, rope, norm eps,
    tying, vocabulary size); only the widths and depth are small.
    """

    arch: str  # "qwen3" | "llama"
    tokenizer: str  # key of real_tokenizers.REAL_TOKENIZERS
    vocab_size: int  # the real config's, which may exceed len(tokenizer)
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    rope_scaling: tuple = ()  # (key, value) pairs of the config's rope_scaling; () for none

    @property
    def head_size(self) -> int:
        return self.head_dim


# Llama-3.1/3.2's frequency scaling of rope (their config.json's "rope_scaling").
LLAMA3_ROPE_SCALING = (
    ("factor", 32.0),
    ("high_freq_factor", 4.0),
    ("low_freq_factor", 1.0),
    ("original_max_position_embeddings", 8192),
    ("rope_type", "llama3"),
)

REAL_ARCH_KIND_SPECS: dict[str, RealArchSpec] = {
    # Qwen3-0.6B-Base in miniature: 1024 hidden / 16 heads = 64 but head_dim 128; here 64 / 4 = 16, head_dim 32.
    "qwen3-tied": RealArchSpec("qwen3", "qwen3", 151_936, 64, 2, 4, 2, 32, 128, True, 1_000_000.0, 1e-6, 32_768),
    # Qwen3-8B-Base is the one preset model with a separate output layer.
    "qwen3-untied": RealArchSpec("qwen3", "qwen3", 151_936, 64, 2, 4, 2, 32, 128, False, 1_000_000.0, 1e-6, 32_768),
    # Llama-3.2-1B: head_dim = hidden / heads (2048 / 32), GQA, tied; here 64 / 2 = 32 with one KV head.
    "llama3p2-tied": RealArchSpec(
        "llama", "llama3", 128_256, 64, 2, 2, 1, 32, 128, True, 500_000.0, 1e-5, 131_072, LLAMA3_ROPE_SCALING
    ),
}

# the presets' architectures with the real tokenizers (fetched on first use; see module docstring)
REAL_ARCH_KINDS = tuple(REAL_ARCH_KIND_SPECS)

ALL_KINDS: dict[str, TinyModelSpec | RealArchSpec] = {**AGENT_KINDS, **REAL_ARCH_KIND_SPECS}
"""Every kind `build_agent` knows."""

DEFAULT_SEEDS.update({"qwen3-tied": 6, "qwen3-untied": 7, "llama3p2-tied": 8})


def head_size(kind: str) -> int:
    """The attention head size of `kind` (what vLLM's CPU attention must accept)."""
    spec = ALL_KINDS[kind]
    return spec.head_dim if isinstance(spec, RealArchSpec) else spec.hidden_size // spec.num_heads


def build_real_arch_model(spec: RealArchSpec, tokenizer: PreTrainedTokenizerFast, seed: int) -> PreTrainedModel:
    """Random-init causal LM of a preset's architecture; float32, sdpa attention."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        hidden_act="silu",
        attention_bias=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.02,
    )
    rope = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if spec.rope_scaling:
        rope = {**dict(spec.rope_scaling), "rope_theta": spec.rope_theta}
    if spec.arch == "qwen3":
        config, cls = Qwen3Config(**common, rope_parameters=rope), Qwen3ForCausalLM
    elif spec.arch == "llama":
        config, cls = LlamaConfig(**common, mlp_bias=False, rope_parameters=rope), LlamaForCausalLM
    else:
        raise ValueError(f"unknown arch {spec.arch!r}")
    return _random_init(cls, config, seed)


def _random_init(cls, config, seed: int) -> PreTrainedModel:
    """`cls(config)` in float32 with sdpa attention, its weights drawn from `seed`."""
    config.dtype = torch.float32
    config._attn_implementation = "sdpa"
    # Seed just around init so building one agent never shifts another agent's weights.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    return model.to(torch.float32).eval()


def build_model(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast, seed: int) -> PreTrainedModel:
    """Random-init causal LM for `spec`; vocab = len(tokenizer), float32, sdpa attention."""
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.02,
    )
    if spec.arch == "qwen2":
        config, cls = Qwen2Config(**common), Qwen2ForCausalLM
    elif spec.arch == "llama":
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    else:
        raise ValueError(f"unknown arch {spec.arch!r}")
    return _random_init(cls, config, seed)


def _generation_config(tokenizer: PreTrainedTokenizerFast) -> GenerationConfig:
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def real_generation_config(spec: RealArchSpec, tokenizer: PreTrainedTokenizerFast) -> GenerationConfig:
    """As the real checkpoints' generation configs: Qwen3 stops on <|im_end|> and <|endoftext|>,
    Llama-3.2 on <|end_of_text|>, <|eom_id|> (128008) and <|eot_id|>."""
    if spec.arch == "qwen3":
        eos = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    else:
        eos = [tokenizer.convert_tokens_to_ids("<|end_of_text|>"), 128_008, tokenizer.eos_token_id]
    return GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)


# ---------------------------------------------------------------------------------------
# agents on disk
# ---------------------------------------------------------------------------------------


def _spec_record(kind: str, seed: int) -> dict:
    if kind in REAL_ARCH_KIND_SPECS:
        spec = REAL_ARCH_KIND_SPECS[kind]
        fields = {**dataclasses.asdict(spec), "rope_scaling": dict(spec.rope_scaling)}
        # the tokenizer's identity: a changed tokenizer (new pinned files) rebuilds the agent
        return {"kind": kind, "seed": int(seed), "version": _SPEC_VERSION, **fields,
                "tokenizer_fingerprint": real_tokenizers.fingerprint(spec.tokenizer)}
    return {"kind": kind, "seed": int(seed), "version": _SPEC_VERSION, **dataclasses.asdict(AGENT_KINDS[kind])}


def _is_built(path: str, record: dict) -> bool:
    try:
        with open(os.path.join(path, SPEC_FILE)) as f:
            return json.load(f) == record
    except (OSError, ValueError):
        return False


def build_agent(out_dir: str, kind: str, seed: int | None = None) -> str:
    """Build agent `kind` into `out_dir/kind` and return that path.

    Idempotent: a directory whose spec marker matches (kind, seed, builder version) is left
    as is. The agent is written to a temporary sibling and renamed into place, so concurrent
    builders (parallel test workers) never observe a half-written directory.
    """
    if kind not in ALL_KINDS:
        raise ValueError(f"unknown agent kind {kind!r}; known: {sorted(ALL_KINDS)}")
    seed = DEFAULT_SEEDS.get(kind, 0) if seed is None else seed
    path = os.path.join(os.path.abspath(out_dir), kind)
    record = _spec_record(kind, seed)
    if _is_built(path, record):
        return path

    os.makedirs(out_dir, exist_ok=True)
    spec = ALL_KINDS[kind]
    if isinstance(spec, RealArchSpec):
        # fetched (or failing with one line) before any model is built
        tokenizer = real_tokenizers.load_tokenizer(spec.tokenizer)
        model = build_real_arch_model(spec, tokenizer, seed)
        model.generation_config = real_generation_config(spec, tokenizer)
    else:
        tokenizer = TOKENIZER_BUILDERS[spec.tokenizer]()
        model = build_model(spec, tokenizer, seed)
        model.generation_config = _generation_config(tokenizer)

    with staging_dir(out_dir, prefix=f".{kind}.") as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, SPEC_FILE), "w") as f:
            json.dump(record, f, indent=2, sort_keys=True)
        if not _is_built(path, record):  # else another process won the race; ours is discarded
            replace_dir(tmp, path)
    return path


def build_default_agents(out_dir: str, kinds: Sequence[str] = DEFAULT_KINDS) -> dict[str, str]:
    """Build every kind in `kinds` (default seeds); returns {kind: path}."""
    return {kind: build_agent(out_dir, kind) for kind in kinds}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build tiny heterogeneous HACPO agents offline.")
    parser.add_argument("--out", required=True, help="directory that receives one sub-directory per agent")
    parser.add_argument("--kinds", nargs="+", default=list(DEFAULT_KINDS), choices=sorted(ALL_KINDS))
    parser.add_argument("--seed", type=int, default=None, help="one seed for all kinds (default: per kind)")
    args = parser.parse_args(argv)
    for kind in args.kinds:
        print(build_agent(args.out, kind, args.seed))


if __name__ == "__main__":
    main()
