"""The attention kernel is checked before Ray: verl builds every actor with flash_attention_2
unless `actor_rollout_ref.model.override_config.attn_implementation` says otherwise, and a GPU
run whose Python cannot import flash_attn would otherwise fail only after Ray and every vLLM
server have started. sdpa/eager need `use_remove_padding=false` (verl's padding-free path packs
sequences into one row; only its flash-attention patch keeps them apart, shown here with sdpa).

No GPU here: a GPU driver is simulated (`_driver_sees_gpu`), the import failure by a None entry
in sys.modules (what Python does for a module that cannot be imported)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from recipe_hacpo import config as config_mod
from recipe_hacpo.config import ATTN_KEY, ConfigError, validate
from helpers.compose import compose_config as _compose

PRESET = "pair_qwen3-1p7b-base_qwen3-4b-base"
GPUS_8 = ["++ray_kwargs.ray_init.num_gpus=8"]




@pytest.fixture
def gpu_driver(monkeypatch):
    monkeypatch.setattr(config_mod, "_driver_sees_gpu", lambda: True)


def _flash_attn(monkeypatch, importable: bool):
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn") if importable else None)


def test_gpu_preset_without_flash_attn_is_refused_in_one_line(gpu_driver, monkeypatch):
    _flash_attn(monkeypatch, importable=False)
    cfg = _compose(PRESET, GPUS_8)
    with pytest.raises(ConfigError) as err:
        validate(cfg, check_paths=False)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("agents.qwen3_1p7b_base: ")
    assert f"{ATTN_KEY}=flash_attention_2 (verl default)" in msg
    assert f"run without it: ++{ATTN_KEY}=sdpa actor_rollout_ref.model.use_remove_padding=false" in msg
    # the exact command that installs a prebuilt wheel, and where to get one
    assert "pip install --no-deps <flash_attn-2.8.3-" in msg and "docs/INSTALL.md" in msg
    assert "ImportError" in msg or "ModuleNotFoundError" in msg


def test_the_refusals_own_fallback_composes_and_passes(gpu_driver, monkeypatch):
    """The overrides the refusal prints, pasted as written, compose and pass the checks; the form
    without `++` stops Hydra (the presets' override_config has no such key)."""
    _flash_attn(monkeypatch, importable=False)
    with pytest.raises(ConfigError) as err:
        validate(_compose(PRESET, GPUS_8), check_paths=False)
    fallback = str(err.value).split("run without it: ")[1].split()
    specs, _ = validate(_compose(PRESET, GPUS_8 + fallback), check_paths=False)
    assert all(config_mod.attention_implementation(_compose(PRESET, GPUS_8 + fallback), s) == "sdpa" for s in specs)
    with pytest.raises(Exception, match="Could not override .actor_rollout_ref.model.override_config.attn_implementation"):
        _compose(PRESET, GPUS_8 + [a.lstrip("+") for a in fallback])


def test_gpu_preset_with_flash_attn_passes(gpu_driver, monkeypatch):
    _flash_attn(monkeypatch, importable=True)  # negative control of the test above
    validate(_compose(PRESET, GPUS_8), check_paths=False)


def test_sdpa_fallback_passes_without_flash_attn(gpu_driver, monkeypatch):
    _flash_attn(monkeypatch, importable=False)
    cfg = _compose(PRESET, GPUS_8 + [f"+{ATTN_KEY}=sdpa", "actor_rollout_ref.model.use_remove_padding=false"])
    specs, _ = validate(cfg, check_paths=False)
    assert all(config_mod.attention_implementation(cfg, s) == "sdpa" for s in specs)


def test_no_gpu_on_the_driver_skips_the_import_check(monkeypatch):
    monkeypatch.setattr(config_mod, "_driver_sees_gpu", lambda: False)
    _flash_attn(monkeypatch, importable=False)
    validate(_compose(PRESET, GPUS_8), check_paths=False)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_non_flash_kernel_with_remove_padding_is_refused(attn):
    cfg = _compose(PRESET, GPUS_8 + [f"+{ATTN_KEY}={attn}"])  # the preset keeps use_remove_padding=true
    with pytest.raises(ConfigError, match=rf"{ATTN_KEY}={attn} with actor_rollout_ref\.model\.use_remove_padding=true"):
        validate(cfg, check_paths=False)


def test_one_agent_override_is_read(gpu_driver, monkeypatch):
    _flash_attn(monkeypatch, importable=False)
    cfg = _compose(PRESET, GPUS_8 + [f"+{ATTN_KEY}=sdpa", "actor_rollout_ref.model.use_remove_padding=false",
                                     f"+agents.qwen3_4b_base.{ATTN_KEY}=flash_attention_2"])
    with pytest.raises(ConfigError, match=r"^agents\.qwen3_4b_base: "):
        validate(cfg, check_paths=False)


def test_flash_attn_problem_names_the_import_error(monkeypatch):
    _flash_attn(monkeypatch, importable=False)
    assert config_mod.flash_attn_problem().startswith(("ImportError", "ModuleNotFoundError"))
    _flash_attn(monkeypatch, importable=True)
    assert config_mod.flash_attn_problem() is None


def test_sdpa_mixes_packed_sequences():
    """Why sdpa needs use_remove_padding=false: two sequences packed into one row as verl's
    padding-free path does (position ids restart, no attention mask) are not kept apart by sdpa."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    cfg._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(cfg).eval()
    a, b = torch.randint(0, 100, (1, 7)), torch.randint(0, 100, (1, 5))
    with torch.no_grad():
        alone_a, alone_b = model(a).logits, model(b).logits
        packed = model(input_ids=torch.cat([a, b], -1), attention_mask=None,
                       position_ids=torch.cat([torch.arange(7), torch.arange(5)])[None]).logits
    assert torch.allclose(packed[:, :7], alone_a, atol=1e-5)  # the first sequence sees only itself
    assert (packed[:, 7:] - alone_b).abs().max() > 1e-2  # the second attends to the first
