"""A tiny real Llama with deterministic random weights, and the greedy loop both paths share.

Colocated generation and PD decode run the very same two steps (one prefill forward, then
one-token forwards over a ``DynamicCache``), so any difference in their tokens comes from the KV
bytes the decode side was handed, never from a different math path (``model.generate`` would add
its own logits processing and cache handling).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from pdfabric_refengine.geometry import HEAD_DIM, KV_HEADS, LAYERS


@dataclass(frozen=True)
class ModelShape:
    """The KV geometry a pool and a PDCluster's `model` section describe."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "float32"
    page_size: int = 16

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{self.dtype!r} is not a torch dtype")
        return dtype

    @property
    def dtype_bytes(self) -> int:
        return self.torch_dtype.itemsize


def build_model(
    seed: int = 0,
    *,
    layers: int = LAYERS,
    kv_heads: int = KV_HEADS,
    heads: int = 8,
    head_dim: int = HEAD_DIM,
    vocab: int = 256,
    hidden: int | None = None,
    initializer_range: float = 0.1,
) -> LlamaForCausalLM:
    """A float32 LlamaForCausalLM in eval mode, built from a config (nothing is downloaded).

    The seed is set right before construction, so the same arguments give the same weights in
    every process. A wider init than Llama's 0.02 gives more varied greedy output (Llama's
    default falls into short repeating loops sooner), so comparing tokens checks more of the KV.
    """
    hidden_size = hidden if hidden is not None else heads * head_dim
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        initializer_range=initializer_range,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    # Eager attention (matmul + softmax): no SDPA backend choice that could differ between the
    # prefill and the decode process of a demo.
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    # In place; a no-op unless torch's default dtype was changed, but the pools and byte checks
    # rely on float32. nn.Module's own .to because transformers' override is untyped.
    torch.nn.Module.to(model, torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    return model


def model_shape(model: LlamaForCausalLM, *, page_size: int = 16) -> ModelShape:
    """The KV geometry of `model` (float32, as `build_model` makes it)."""
    config = model.config
    head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
    return ModelShape(
        layers=config.num_hidden_layers,
        kv_heads=config.num_key_value_heads or config.num_attention_heads,
        head_dim=head_dim,
        dtype=str(model.dtype).removeprefix("torch."),
        page_size=page_size,
    )


@torch.inference_mode()
def prefill_forward(model: LlamaForCausalLM, prompt_ids: list[int]) -> tuple[DynamicCache, int]:
    """One forward over the whole prompt: the filled cache and the greedy first token."""
    if not prompt_ids:
        raise ValueError("the prompt must hold at least one token")
    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([prompt_ids], device=model.device), past_key_values=cache, use_cache=True)
    return cache, int(out.logits[0, -1].argmax())


@torch.inference_mode()
def greedy_continue(model: LlamaForCausalLM, cache: DynamicCache, first_token: int, max_new_tokens: int) -> list[int]:
    """Greedy tokens after a prefill: `first_token` first, then one-token forwards over `cache`.

    Positions come from the cache's length (Llama's forward derives them), so a cache rebuilt
    from pool pages continues exactly where the prefill stopped.
    """
    tokens: list[int] = []
    token = first_token
    while len(tokens) < max_new_tokens:
        tokens.append(token)
        if len(tokens) == max_new_tokens:
            break
        out = model(input_ids=torch.tensor([[token]], device=model.device), past_key_values=cache, use_cache=True)
        token = int(out.logits[0, -1].argmax())
    return tokens


def colocated_generate(model: LlamaForCausalLM, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy generation in one place: the reference a PD hand-off must reproduce."""
    cache, first = prefill_forward(model, prompt_ids)
    return greedy_continue(model, cache, first, max_new_tokens)
