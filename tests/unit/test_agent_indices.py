"""Index lists in API bodies: plain JSON lists or the packed form (base64 little-endian int32),
checked the same way; anything else is refused with what to fix."""

from __future__ import annotations

import base64
import random
import struct

import pytest

from pdfabric_agent.protocol.errors import ApiError
from pdfabric_agent.protocol.fields import PACKED_INDICES, field_indices, pack_indices


def check(value: object, limit: int = 100, unique: bool = True) -> list[int]:
    return field_indices({"kv_pages": value}, "kv_pages", limit, what="KV pages", unique=unique)


def test_packed_and_plain_lists_mean_the_same() -> None:
    pages = random.Random(4).sample(range(100), 60)
    packed = pack_indices(pages)
    assert set(packed) == {PACKED_INDICES}
    assert base64.b64decode(packed[PACKED_INDICES]) == struct.pack("<60i", *pages)
    assert check(packed) == check(pages) == pages
    assert check(pack_indices([])) == []


@pytest.mark.parametrize(
    ("value", "status", "message"),
    [
        ([1, 2, 100], 400, "outside 0..99"),
        (pack_indices([1, 2, 100]), 400, "outside 0..99"),
        (pack_indices([-1]), 400, "outside 0..99"),
        (pack_indices([3, 4, 3]), 400, "repeat"),
        ([1, True], 400, "list of integers"),
        ([1, 2.0], 400, "list of integers"),
        ("1,2", 400, "list of integers"),
        ({PACKED_INDICES: "not base64!"}, 400, "not base64"),
        ({PACKED_INDICES: base64.b64encode(b"\x01\x00\x00").decode()}, 400, "not a whole number of int32"),
        ({PACKED_INDICES: "", "extra": 1}, 400, "list of integers or"),
        ({"int64le": ""}, 400, "list of integers or"),
    ],
)
def test_bad_index_lists_are_refused(value: object, status: int, message: str) -> None:
    with pytest.raises(ApiError) as err:
        check(value)
    assert err.value.status == status and message in err.value.message


def test_repeats_are_allowed_where_the_caller_says_so() -> None:
    assert check(pack_indices([3, 3]), unique=False) == [3, 3]
