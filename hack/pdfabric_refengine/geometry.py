"""The reference engine's model as a PDCluster describes it (``spec.model``): the one place for its
shape, used by ``build_model``'s defaults, the tests and the demo."""

from __future__ import annotations

from typing import Any

LAYERS = 2
KV_HEADS = 4
HEAD_DIM = 16
PAGE_SIZE = 16
DTYPE = "float32"
AUX_ROW_BYTES = (64, 64, 64)  # kvpool.AUX_ITEMS, bytes per row (tests/unit/test_refengine.py keeps them equal)

SPEC_MODEL: dict[str, Any] = {
    "layers": LAYERS,
    "kvHeads": KV_HEADS,
    "headDim": HEAD_DIM,
    "dtype": DTYPE,
    "pageSizeTokens": PAGE_SIZE,
    "stateBytesPerRequest": 0,
    "auxRowBytes": list(AUX_ROW_BYTES),
}
