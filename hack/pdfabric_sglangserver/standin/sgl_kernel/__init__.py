"""TEST STAND-IN for SGLang's CPU kernel library (``sgl_kernel``), not the real thing.

No CPU build of ``sgl_kernel`` is on the package index, and SGLang's CPU engine imports a few of its
``*_cpu`` helpers at start-up with no fallback. This module gives the two that a dense Llama calls
(written in torch, slow and simple) and the names of the speculative-decoding helpers, which such a
model never calls. It sits on the PYTHONPATH of the SGLang servers that tests and the demo start on
CPU, and nowhere else: it touches no transfer path (the KV moves through SGLang's transfer backend).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

__version__ = "0.0.0+pdfabric-test-standin"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    max_context_len: int,
) -> None:
    """Write each request's new cache locations into its row of ``req_to_token``."""
    taken = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[taken : taken + n].to(req_to_token.dtype)
        taken += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """Copy token rows ``src_loc`` to ``tgt_loc`` in every buffer (``strides``: bytes per row)."""
    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist(), strict=True))
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        for tgt, src in pairs:
            ctypes.memmove(ptr + tgt * stride, ptr + src * stride, stride)


def _not_for_a_dense_model(name: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"{name}: the pdfabric test stand-in for sgl_kernel covers only a dense Llama")

    refuse.__name__ = name
    return refuse


# Imported by SGLang's speculative-decoding and AMX modules at start-up; never called for a dense
# Llama on the torch-native backend.
rotate_input_ids_cpu = _not_for_a_dense_model("rotate_input_ids_cpu")
fill_accept_out_cache_loc_cpu = _not_for_a_dense_model("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _not_for_a_dense_model("fill_bonus_tokens_cpu")
assign_draft_cache_locs_contiguous_cpu = _not_for_a_dense_model("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _not_for_a_dense_model("assign_extend_cache_locs_cpu")
build_tree_kernel_efficient_cpu = _not_for_a_dense_model("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _not_for_a_dense_model("verify_tree_greedy_cpu")
build_draft_decode_metadata_cpu = _not_for_a_dense_model("build_draft_decode_metadata_cpu")
