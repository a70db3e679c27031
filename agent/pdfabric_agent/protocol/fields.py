"""The fields of the wire messages: typed, bounded readers of parsed JSON values.

Each reader checks one value (its type, its closed set or bounds, its length before any decoding)
and raises ``ApiError`` naming the field and what to fix; ``wire`` builds its messages from them.
The caps below are what no legal message exceeds, whatever the pools (docs/agent.md, "Limits").
"""

from __future__ import annotations

import array
import base64
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from pdfabric_agent.protocol.errors import ApiError, malformed, out_of_range
from pdfabric_agent.protocol.labels import Refusal

PACKED_INDICES = "int32le"  # {"int32le": base64 of little-endian int32}: a compact list of indices
PACK_ABOVE = 64  # index lists longer than this are sent packed

# The pools' own bounds (a page list no longer than the pool has pages) are checked against the
# rank's layout (``check_indices``); the body cap (``jsonbody.body_cap``) comes first.
MAX_INT = 2**64 - 1  # every integer on the wire: rooms, indices, offsets, bytes, addresses
MAX_STR = 256  # rank ids, endpoints, paths, board names: printable ASCII
MAX_REASON = 1024  # a failure reason a peer sends (free text, shown in the room view)
MAX_INDICES = 1 << 24  # an index list, before the pool's own bound
MAX_AUX_ITEMS = 64  # aux items of a layout, and aux rows of a done report
MAX_AUX_ROW_BYTES = 1 << 20  # one aux row in a done report
MAX_PATHS = 16  # paths in bytes_by_path
MAX_MARKS = 1024  # completion marks of a launch notice
MAX_BUFFERS = 4096  # buffers of one kind in an engine's registration (K or V layers, state layers, aux items)


def too_large(message: str) -> ApiError:
    return ApiError(413, Refusal.TOO_LARGE, message)


def field_int(body: Mapping[str, Any], name: str, *, minimum: int = 0, maximum: int = MAX_INT) -> int:
    if name not in body or body[name] is None:
        raise malformed(f"field {name!r} is required")
    return _int(body[name], name, minimum, maximum)


def field_opt_int(body: Mapping[str, Any], name: str, *, minimum: int = 0, maximum: int = MAX_INT) -> int | None:
    value = body.get(name)
    return None if value is None else _int(value, name, minimum, maximum)


def _int(value: Any, name: str, minimum: int, maximum: int = MAX_INT) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise malformed(f"field {name!r} must be an integer, got {type(value).__name__}")
    if not minimum <= value <= maximum:
        shown = value if value.bit_length() <= 128 else f"a {value.bit_length()}-bit integer"
        raise out_of_range(f"field {name!r} must be within {minimum}..{maximum}, got {shown}")
    return value


def check_str(value: Any, name: str, *, limit: int = MAX_STR) -> str:
    """A non-empty printable ASCII string of at most ``limit`` characters (it becomes a lookup
    key, an address, a file name or a log line: no control characters, no lone surrogates)."""
    if not isinstance(value, str) or not value:
        raise malformed(f"field {name!r} must be a non-empty string")
    if len(value) > limit:
        raise too_large(f"field {name!r} has {len(value)} characters; at most {limit}")
    if not (value.isascii() and value.isprintable()):
        raise malformed(f"field {name!r} must be printable ASCII")
    return value


def field_flag(body: Mapping[str, Any], name: str) -> bool:
    """An optional boolean, false when absent."""
    value = body.get(name, False)
    if type(value) is not bool:
        raise malformed(f"{name} must be true or false")
    return value


def field_str(body: Mapping[str, Any], name: str) -> str:
    return check_str(body.get(name), name)


def field_opt_str(body: Mapping[str, Any], name: str) -> str:
    """An optional string (``check_str``), empty when absent."""
    return "" if body.get(name) is None else check_str(body[name], name)


def pack_indices(values: Sequence[int]) -> dict[str, str]:
    """The compact form of an index list (a room of thousands of pages: no JSON number per page)."""
    a = array.array("i", values)
    if sys.byteorder != "little":
        a.byteswap()
    return {PACKED_INDICES: base64.b64encode(a.tobytes()).decode()}


def indices_json(values: Sequence[int]) -> list[int] | dict[str, str]:
    return pack_indices(values) if len(values) > PACK_ABOVE else list(values)


def _unpack_indices(name: str, value: Mapping[str, Any], limit: int = MAX_INDICES) -> list[int]:
    raw = value.get(PACKED_INDICES)
    if set(value) != {PACKED_INDICES} or not isinstance(raw, str):
        raise malformed(f"field {name!r} must be a list of integers or {{{PACKED_INDICES!r}: base64}}")
    # Checked before decoding: base64 of n int32 is 4 * ceil(4n / 3) characters.
    if len(raw) > 4 * -(-4 * limit // 3):
        raise too_large(f"field {name!r}: {PACKED_INDICES} of {len(raw)} characters holds more than {limit} indices")
    try:
        data = base64.b64decode(raw, validate=True)
    except ValueError:
        raise malformed(f"field {name!r}: {PACKED_INDICES} is not base64") from None
    if len(data) % 4:
        raise malformed(f"field {name!r}: {PACKED_INDICES} holds {len(data)} bytes, not a whole number of int32")
    a = array.array("i")
    a.frombytes(data)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


def field_index_list(body: Mapping[str, Any], name: str, limit: int = MAX_INDICES) -> list[int]:
    """A list of at most ``limit`` integers, plain or packed (its bounds are the caller's:
    ``check_indices``)."""
    value = body.get(name, [])
    limit = min(limit, MAX_INDICES)
    if isinstance(value, Mapping):
        return _unpack_indices(name, value, limit)  # ints by construction
    # `type(v) is int` refuses bools too; it runs at C speed for a room of thousands of pages.
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise malformed(f"field {name!r} must be a list of integers")
    if len(value) > limit:
        raise too_large(f"field {name!r} has {len(value)} entries; at most {limit}")
    return value


def check_indices(values: list[int], limit: int, *, name: str, what: str, unique: bool) -> None:
    # A list longer than the pool has entries is refused before anything else looks at it.
    if len(values) > limit:
        raise too_large(f"{name}: {len(values)} {what}, but the pool has only {limit}")
    # min/max run in C: a room of thousands of pages is checked in tens of microseconds.
    if values and (min(values) < 0 or max(values) >= limit):
        bad = [v for v in values if not 0 <= v < limit]
        raise out_of_range(f"{name}: {what} {bad[:5]} outside 0..{limit - 1}")
    if unique and len(set(values)) != len(values):
        raise malformed(f"{name}: {what} repeat; every destination must be written once")


def field_indices(body: Mapping[str, Any], name: str, limit: int, *, what: str, unique: bool) -> list[int]:
    values = field_index_list(body, name, limit)
    check_indices(values, limit, name=name, what=what, unique=unique)
    return values


def check_index(value: int | None, limit: int, *, name: str) -> None:
    if value is not None and not 0 <= value < limit:
        raise out_of_range(f"{name} {value} outside 0..{limit - 1}")


def check_object(value: Any, name: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise malformed(f"{name} must be an object")
    return value


# Aux rows on the wire: a send's, a done report's and a room view's, one base64 string per aux item.
def aux_rows_json(rows: Sequence[bytes]) -> list[str]:
    """Aux rows on the wire: one base64 string per aux item."""
    return [base64.b64encode(row).decode() for row in rows]


def decode_aux_row(data: str, shape: str) -> bytes:
    """One aux row in base64 (at most ``MAX_AUX_ROW_BYTES``, its length checked before decoding);
    ``shape`` is the refusal that says what the field must be. Done reports and sends read theirs
    with it."""
    if len(data) > 4 * -(-MAX_AUX_ROW_BYTES // 3):
        raise too_large(f"an aux row of {len(data)} base64 characters; rows are at most {MAX_AUX_ROW_BYTES} bytes")
    try:
        return base64.b64decode(data, validate=True)
    except ValueError:  # binascii.Error, and non-ASCII characters
        raise malformed(shape) from None


def parse_aux_rows(value: Any, name: str) -> tuple[bytes, ...]:
    """Aux rows from the wire (``aux_rows_json``), each at most ``MAX_AUX_ROW_BYTES``."""
    shape = f"field {name!r} must be a list of base64 strings, one per aux item"
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise malformed(shape)
    if len(value) > MAX_AUX_ITEMS:
        raise too_large(f"field {name!r} has {len(value)} rows; at most {MAX_AUX_ITEMS}")
    return tuple(decode_aux_row(v, shape) for v in value)
