"""A reference engine for tests and demos: a tiny real Llama, SGLang-layout paged KV pools, and
prefill/decode around them, so a transfer fabric can be checked end to end by the tokens it yields.

The decode side rebuilds the model's KV cache from pool pages only, so greedy decode after a PD
hand-off equals colocated generation token for token exactly when every byte arrived.
"""

from __future__ import annotations

from pdfabric_refengine.engine import decode, gather_kv, pages_for, prefill, prefill_cp, token_slots
from pdfabric_refengine.kvpool import AUX_ITEMS, AuxItem, BufferInfo, KVPool, kv_args
from pdfabric_refengine.model import ModelShape, build_model, colocated_generate, greedy_continue, model_shape

__all__ = [
    "AUX_ITEMS",
    "AuxItem",
    "BufferInfo",
    "KVPool",
    "ModelShape",
    "build_model",
    "colocated_generate",
    "decode",
    "gather_kv",
    "greedy_continue",
    "kv_args",
    "model_shape",
    "pages_for",
    "prefill",
    "prefill_cp",
    "token_slots",
]
