"""A model directory SGLang's server loads like a downloaded checkpoint: a small Llama's config,
weights drawn from a seed (safetensors) and a byte-level tokenizer, all built here (nothing
downloaded). The weights are drawn wide (``INIT_RANGE``, not SGLang's ``--load-format dummy`` range
of 1e-3, under which attention is nearly uniform and the KV barely changes the next token): here
each generated token depends on the whole context, so a decode that did not get the prompt's KV
exactly would not generate the same tokens as a single server."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Small enough for 2 CPU cores, shaped like a real GQA Llama: 2 layers, 4 query heads over 2 KV heads.
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 320,
    "bos_token_id": 256,
    "eos_token_id": 257,
}
INIT_RANGE = 0.3  # the std of the seeded normal weights (HF's initializer_range)
SEED = 0
SPECIALS = ["<s>", "</s>"]  # ids 256 and 257: every byte is one token below them


@dataclass(frozen=True)
class Variant:
    """``CONFIG`` or the same model with other KV heads, dtype or layers. One KV head: every query
    head shares it, so each of several TP ranks holds a copy. Three layers: two PP stages split them
    unevenly (SGLang gives the last stage the extra layer). float32: a server of several TP ranks sums
    its partial results in another order than one rank does; in bfloat16 that rounding alone turns
    some greedy tokens, in float32 it stays far below the gap between the top two logits."""

    kv_heads: int = 2
    dtype: str = "bfloat16"
    layers: int = 2
    # vLLM's CPU attention takes head_dim 32 and more (16 is refused at the first request); the
    # hidden and MLP widths follow it (4 query heads).
    head_dim: int = 16

    @property
    def config(self) -> dict[str, object]:
        return {
            **CONFIG,
            "num_key_value_heads": self.kv_heads,
            "torch_dtype": self.dtype,
            "num_hidden_layers": self.layers,
            "head_dim": self.head_dim,
            "hidden_size": 4 * self.head_dim,
            "intermediate_size": 8 * self.head_dim,
        }

    @property
    def name(self) -> str:
        hd = f"-hd{self.head_dim}" if self.head_dim != CONFIG["head_dim"] else ""
        return f"l{self.layers}-kv{self.kv_heads}-{self.dtype}{hd}"

    @property
    def server_flags(self) -> list[str]:
        """What a server of this variant needs: its dtype said (SGLang's ``auto`` computes a float32
        checkpoint in 16 bits)."""
        return ["--dtype", self.dtype]


DEFAULT = Variant()


def spec_model(page_size: int, variant: Variant = DEFAULT) -> dict[str, object]:
    """The same model as a PDCluster's ``spec.model`` (the agent checks SGLang's buffers against it)."""
    return {
        "layers": variant.layers,
        "kvHeads": variant.kv_heads,
        "headDim": variant.head_dim,
        "dtype": variant.dtype,
        "pageSizeTokens": page_size,
    }


def metadata_row_bytes() -> list[int]:
    """Bytes per row of each of SGLang's ``MetadataBuffers`` as its scheduler builds them without
    speculative decoding (hidden states padded to 16 float32, scheduler.py): what the engines
    register (a PDCluster's ``spec.model.auxRowBytes`` only predicts traffic with it)."""
    import torch
    from sglang.srt.disaggregation.utils import MetadataBuffers

    bufs = MetadataBuffers(2, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=4096)
    return [int(n) for n in bufs.get_buf_infos()[2]]


def spec_model_for_servers(page_size: int, variant: Variant = DEFAULT) -> dict[str, object]:
    """``spec.model`` of a PDCluster serving this model with SGLang's servers: the geometry alone.
    The metadata rows are what SGLang's engines register (``auxRowBytes`` is left at its default,
    which is not these servers' rows: the agents take the engines' and check them between roles)."""
    return spec_model(page_size, variant)


def write_model_dir(path: Path, variant: Variant = DEFAULT) -> Path:
    """Write the config, weights and tokenizer into ``path`` (idempotent) and return it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    write_weights(path, variant)
    (path / "config.json").write_text(json.dumps(variant.config, indent=1))
    vocab = {ch: i for i, ch in enumerate(_byte_alphabet_in_order())}  # token id = byte value
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "model_max_length": CONFIG["max_position_embeddings"],
                "add_bos_token": False,
            }
        )
    )
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 256, "eos_token_id": 257}))
    return path


def write_weights(path: Path, variant: Variant = DEFAULT) -> None:
    """The model's weights from ``SEED`` (safetensors in the variant's dtype), the same on every call."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    skip = ("architectures", "model_type", "torch_dtype")
    fields = {k: v for k, v in variant.config.items() if k not in skip}
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**fields, initializer_range=INIT_RANGE)).to(getattr(torch, variant.dtype))
    model.save_pretrained(path, safe_serialization=True)


def _byte_alphabet_in_order() -> list[str]:
    """GPT-2's byte-to-unicode table, in byte order (bytes 0..255)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]
