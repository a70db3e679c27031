"""SGLang's logical-page KV cache sharding (``--enable-kv-cache-sharding``, PD prefill only).

SGLang stripes whole pages (never slices of a page) over the group that would otherwise hold
replicas of them (``page_interleave.get_kv_shard_group``): the attention CP group when prefill CP is
on (any attention kind), else the attention TP group for MLA, whose latent every attention-TP rank
computes whole; GQA without CP has no replicated axis, so nothing is sharded (group size 1).

Logical page ``l`` (the page id in the request's ``req_to_token`` row, what the scheduler hands the
sender) lives on shard rank ``l % N`` as local page ``l // N`` of that rank's pool. A prefill rank
therefore sends, of the request's page list, only the positions whose page it owns, from its local
page, to the decode page at the same position (SGLang's ``filter_kv_indices_for_shard_rank``);
decode is not sharded (SGLang refuses the option there) and holds every page whole.

With MLA sharded over attention TP and prefill CP 1, every decode rank pulls from ALL prefill
attention-TP ranks, which requires equal attention TP on both sides, and counts one response per
prefill rank (``_resolve_rank_mapping``). Over the pages of one request the shard ranks' positions
partition the request: each position comes from exactly one prefill rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def kv_shard_size(*, enabled: bool, mla: bool, attn_tp: int, attn_cp: int) -> int:
    """Ranks SGLang stripes KV pages over (1: not sharded), by its choice of shard group."""
    if attn_tp < 1 or attn_cp < 1:
        raise ValueError(f"attention TP {attn_tp} and CP {attn_cp} must be at least 1")
    if not enabled:
        return 1
    if attn_cp > 1:
        return attn_cp
    return attn_tp if mla else 1


def shard_owner(page: int, shard_size: int) -> int:
    """The shard rank whose pool holds logical page ``page``."""
    if shard_size < 1 or page < 0:
        raise ValueError(f"page {page} in a shard group of {shard_size} ranks")
    return page % shard_size


def local_page(page: int, shard_size: int) -> int:
    """Where logical page ``page`` sits in its owner's pool."""
    if shard_size < 1 or page < 0:
        raise ValueError(f"page {page} in a shard group of {shard_size} ranks")
    return page // shard_size


@dataclass(frozen=True)
class OwnedPages:
    """What one shard rank sends of a request's page list: its local pages, and for each the
    position in the request (the index of decode's destination page), in request order."""

    local: tuple[int, ...]
    positions: tuple[int, ...]


def owned_pages(
    logical_pages: Sequence[int], shard_rank: int, shard_size: int, *, first_position: int = 0
) -> OwnedPages:
    """The pages of ``logical_pages`` (a chunk starting at request position ``first_position``)
    that shard rank ``shard_rank`` owns, as its local pages and their request positions."""
    if not 0 <= shard_rank < shard_size:
        raise ValueError(f"shard rank {shard_rank} is outside a shard group of {shard_size} ranks")
    if first_position < 0:
        raise ValueError(f"a chunk cannot start at request position {first_position}")
    local: list[int] = []
    positions: list[int] = []
    for i, page in enumerate(logical_pages):
        if shard_owner(page, shard_size) == shard_rank:
            local.append(local_page(page, shard_size))
            positions.append(first_position + i)
    return OwnedPages(tuple(local), tuple(positions))


def sharded_sources(decode_tp_rank: int, *, prefill_tp: int, decode_tp: int, prefill_cp: int) -> list[int]:
    """The prefill attention-TP ranks a decode rank receives from when the prefill's MLA latent is
    sharded over attention TP: all of them. SGLang requires equal attention TP on both sides and
    handles prefill CP > 1 by sharding over CP instead (not this rule)."""
    if prefill_cp != 1:
        raise ValueError(
            f"prefill attention CP is {prefill_cp}: SGLang then shards KV pages over the CP group, not attention TP"
        )
    if prefill_tp != decode_tp:
        raise ValueError(
            "MLA KV cache sharding requires equal prefill/decode attention TP sizes, "
            f"got prefill={prefill_tp} decode={decode_tp}"
        )
    if not 0 <= decode_tp_rank < decode_tp:
        raise ValueError(f"decode TP rank {decode_tp_rank} is outside decode TP size {decode_tp}")
    return list(range(prefill_tp))


def pages_per_source(logical_pages: Sequence[int], shard_size: int) -> list[int]:
    """How many of a request's pages each shard rank sends (they sum to the request's pages): a
    sharded prefill rank's bytes depend on which logical pages the allocator gave the request."""
    counts = [0] * shard_size
    for page in logical_pages:
        counts[shard_owner(page, shard_size)] += 1
    return counts


def cyclic_pages_per_source(num_pages: int, shard_size: int, first_owner: int) -> list[int]:
    """Pages each shard rank sends of a request whose pages SGLang's allocator drew cyclically
    (position ``i`` owned by ``(first_owner + i) % N``, its rotation policy for one cached chain):
    ``num_pages // N`` each, one more for the ``num_pages % N`` ranks from ``first_owner`` on. The
    operator cannot know ``first_owner`` (the allocator's least-full class), only these bounds; a
    decode rank receives all ``num_pages`` pages whatever it is."""
    if shard_size < 1 or not 0 <= first_owner < shard_size or num_pages < 0:
        raise ValueError(f"{num_pages} pages from owner {first_owner} in a shard group of {shard_size} ranks")
    base, extra = divmod(num_pages, shard_size)
    return [base + (1 if (r - first_owner) % shard_size < extra else 0) for r in range(shard_size)]
