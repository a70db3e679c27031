"""CP-replicated state dedup (sglang #36025, mirrors Mooncake #32620).

Prefill context parallelism all-gathers into global token order before writing the state pools,
so every CP rank holds the same state. Only CP rank 0 sends it, unless the DSA cache layer split
is on: then each CP rank owns different state layers and must send its own.
Risk carried from upstream: a future state kind that is not replicated would be silently dropped.
"""

from __future__ import annotations


def should_skip_state_transfer(cp_size: int, cp_rank: int, *, dsa_cache_layer_split: bool) -> bool:
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside a CP group of size {cp_size}")
    return cp_size > 1 and cp_rank != 0 and not dsa_cache_layer_split
