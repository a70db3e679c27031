"""SGLang's state components (``KVArgs.state_types`` and the lists beside it, as its
``setup_state_kv_args`` appends them) as the agent takes them: one typed component (``StateParts``),
or a refusal that names what pdfabric does not move.

SGLang's state type tells how a room indexes it, which is the rule its bytes move by
(pdfabric_core.policy.state_slices): ``mamba`` by slot, its tensors of different sizes and each
head-sharded over attention TP where ``state_dim_per_tensor`` is above 0 (GDN's conv state in
q, k and v sub-blocks sharded apart: ``state_conv_shard_groups``); ``swa`` by page (the
window pages of an SWA hybrid's sub-pool, heads sharded like KV); ``dsa`` by page too (DeepSeek-V3.2's
indexer keys and scales beside its MLA latent, one page item a layer, indexed by the request's KV
pages and whole on every attention-TP rank, like the latent); ``request_row`` one whole row a
request.

Several SGLang components on a rank move as one when SGLang indexes them alike on both sides
(``MERGED``): an SWA hybrid's MXFP8 block scales (``block_scale_swa``) are page state indexed by
the very window pages of its ``swa`` component (SGLang's prefill and decode both build its indices
with ``_swa_payload``), so their buffers follow the SWA buffers in one page component and a room's
one list of state indices serves both. Components indexed apart (DeepSeek-V4's ``swa`` and
``c128_state``, DSA beside Mamba, the full pool's ``block_scale``) are refused by name."""

from __future__ import annotations

from typing import Any

from pdfabric_agent.client.shares import UnshareableBuffer
from pdfabric_agent.protocol.buffers import StateParts
from pdfabric_core.policy.types import StateKind

KIND_OF = {"mamba": StateKind.SLOT, "swa": StateKind.PAGE, "dsa": StateKind.PAGE, "request_row": StateKind.ROW}
# SGLang's state types that may sit beside an MLA latent (a hybrid MLA pool is refused before).
BESIDE_MLA = ("dsa", "mamba")
# SGLang state types that ride with a first component, its indices being that component's own.
MERGED = {("swa", "block_scale_swa")}
# SGLang's MXFP8 pool lays its scales out in FA4's interleaved page atom (head-major inside a page)
# at this page size, flat per token (token-major, as pdfabric slices page state) at any other.
MXFP8_INTERLEAVED_PAGE = 128


def state_type_names(args: Any) -> list[str]:
    """SGLang's state types of ``args``, by their wire value (``StateType`` is a str enum)."""
    return [str(getattr(t, "value", t)) for t in (getattr(args, "state_types", None) or [])]


def _per_tensor(args: Any, name: str, n: int, default: Any) -> list[Any]:
    lists = getattr(args, name, None) or []
    given = list(lists[0]) if lists else []
    return given or [default] * n


def state_parts(args: Any, *, is_mla: bool) -> StateParts | None:
    """The one state component of ``args`` typed, None without state; ``UnshareableBuffer`` naming
    SGLang's state types pdfabric does not move."""
    names = state_type_names(args)
    if not names:
        return None
    if tuple(names) in MERGED:
        return _merged(args, names, is_mla=is_mla)
    moved = [n for n in names if n in KIND_OF]
    if len(names) > 1:
        not_moved = [n for n in names if n not in KIND_OF] or names[1:]
        raise UnshareableBuffer(
            f"state components {names}: pdfabric moves one state component a rank ({', '.join(KIND_OF)}), "
            f"or {' with '.join(next(iter(MERGED)))} as one; {not_moved} would not move"
        )
    name = names[0]
    if not moved:
        raise UnshareableBuffer(
            f"SGLang's {name!r} state: pdfabric moves mamba (slot), swa and dsa (page) and request_row (row) state only"
        )
    if is_mla and name not in BESIDE_MLA:  # V4's state sets arrive as several components, refused above
        raise UnshareableBuffer(
            f"state kind {name!r} beside MLA: pdfabric moves DSA's indexer (page) and Mamba (slot) state beside MLA"
        )
    if name == "dsa" and not is_mla:
        raise UnshareableBuffer("SGLang's 'dsa' indexer state beside an MHA pool: DSA pools are MLA pools")
    kind = KIND_OF[name]
    items = [int(i) for i in args.state_item_lens[0]]
    if name == "dsa" and min(items, default=1) < 1:
        raise UnshareableBuffer(
            f"DSA indexer layers without index keys (item bytes {items}: SGLang's shared top-k layers, "
            "skip_topk_layers / index-K elision, GLM-5 and LongCat): pdfabric moves an indexer page on every layer"
        )
    if len(set(items)) != 1 and kind is not StateKind.SLOT:
        raise UnshareableBuffer(f"{name} state buffers of different item sizes {sorted(set(items))}")
    outer = _per_tensor(args, "state_slice_outer_counts", len(items), 1)
    if any(int(c) != 1 for c in outer):
        raise UnshareableBuffer(
            f"{name} state sliced inside its rows (state_slice_outer_counts {outer}: Kimi's conv state): "
            "pdfabric slices one contiguous shard a tensor"
        )
    dims = _per_tensor(args, "state_dim_per_tensor", len(items), 0)
    if kind is StateKind.PAGE:
        sharded = [True] * len(items)  # SWA pages hold this rank's KV heads, like its KV
    elif kind is StateKind.ROW:
        sharded = [False] * len(items)
    else:
        sharded = [int(d) > 0 for d in dims]
    return StateParts(kind, name, tuple(items), tuple(sharded), _blocks(args, items, dims))


def _blocks(args: Any, items: list[int], dims: list[Any]) -> tuple[tuple[int, ...], ...]:
    """GDN's conv sub-blocks (``state_conv_shard_groups``: whole dims of q, k, v, each head-sharded
    apart) as whole bytes: a dim is the item's bytes over this rank's dims of the tensor. Only the
    groups SGLang itself slices by (their sum is the tensor's whole dim) count."""
    groups = _per_tensor(args, "state_conv_shard_groups", len(items), None)
    if not any(g is not None for g in groups):
        return ()
    out: list[tuple[int, ...]] = []
    for item, dim, group in zip(items, dims, groups, strict=True):
        dim = int(dim)
        if group is None or not dim or item % dim:
            out.append(())
            continue
        whole = [int(g) * (item // dim) for g in group]
        if sum(whole) % item:  # not a whole number of TP shares: SGLang slices it as one block
            out.append(())
            continue
        out.append(tuple(whole))
    return tuple(out)


def _merged(args: Any, names: list[str], *, is_mla: bool) -> StateParts:
    """SWA pages and their MXFP8 block scales as one page component: the SWA K and V buffers, then
    the scales' K and V buffers, each item one window page of this rank's KV heads."""
    if is_mla:
        raise UnshareableBuffer(f"state components {names} beside MLA: pdfabric moves slot-indexed (Mamba) state only")
    if int(getattr(args, "page_size", 0) or 0) == MXFP8_INTERLEAVED_PAGE:
        raise UnshareableBuffer(
            f"{names[1]} at page size {MXFP8_INTERLEAVED_PAGE}: SGLang keeps these scales in FA4's interleaved "
            "page layout (head-major in a page); pdfabric slices page state by token rows. Serve another page size"
        )
    items = [int(i) for per in args.state_item_lens[: len(names)] for i in per]
    return StateParts(StateKind.PAGE, "+".join(names), tuple(items), (True,) * len(items))


def state_buffers(args: Any, parts: StateParts | None) -> tuple[list[int], list[int]]:
    """The data pointers and lengths of the state buffers ``parts`` types, in its order (a merged
    component's buffers, component after component)."""
    if parts is None:
        return [], []
    n = len(parts.source.split("+"))
    ptrs = [int(p) for per in args.state_data_ptrs[:n] for p in per]
    lens = [int(x) for per in args.state_data_lens[:n] for x in per]
    return ptrs, lens
