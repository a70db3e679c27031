"""DeepSeek-V4's transfer geometry read off SGLang's own V4 pools, and the CP8 -> TP8 dedup figure
pdfabric predicts from a PDCluster spec of it (benchmarks/v4_geometry.py, bench_v4_dedup.py)."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("sglang")

from benchmarks.v4_geometry import (
    V4Geometry,
    default_ratios,
    from_sglang,
    pdcluster_spec,
    sglang_reduction,
)
from pdfabric_core.spec import parse_spec
from pdfabric_core.traffic import estimate_traffic
from tests.builders import pdcluster


@pytest.fixture(scope="module")
def geo() -> V4Geometry:
    return from_sglang()


def test_sglangs_v4_pools_register_the_flashmla_layout_and_fp32_rings(geo: V4Geometry) -> None:
    # 448 fp8 nope + 64 bf16 rope + 7 scales + 1 pad = 584 bytes a token, pages padded to 576 bytes.
    assert geo.c4_kv == math.ceil(64 * 584 / 576) * 576
    assert geo.c128_kv == math.ceil(2 * 584 / 576) * 576
    assert geo.swa_page == math.ceil(256 * 584 / 576) * 576
    assert geo.c4_indexer == 64 * (128 + 128 // 128 * 4)  # fp8 keys + one fp32 scale per 128
    # Rings of fp32 (kv, score), overlapped at ratio 4: 8 rows; C128's raw ring 128 rows.
    assert geo.c4_state == 8 * 2 * 2 * 512 * 4
    assert geo.c4_indexer_state == 8 * 2 * 2 * 128 * 4
    assert geo.c128_state == 128 * 2 * 512 * 4
    assert (geo.n4, geo.n128, len(geo.ratios)) == (21, 20, 43)


@pytest.mark.parametrize(
    ("tokens", "pages"),
    [(1, 1), (128, 1), (129, 1), (256, 1), (300, 2), (384, 1), (385, 1), (513, 2), (1100, 2), (1152, 1)],
)
def test_the_window_spans_the_pages_sglangs_prefill_sends(geo: V4Geometry, tokens: int, pages: int) -> None:
    # SGLang's _swa_payload: from max(0, L - 128) rounded down to a 256-token page, to the end.
    assert geo.window_pages(tokens) == pages


@pytest.mark.parametrize("tokens", [1, 512, 1024, 1100, 4096, 32768, 131072])
def test_pdfabrics_prediction_reads_sglangs_reduction(geo: V4Geometry, tokens: int) -> None:
    spec = parse_spec(pdcluster_spec(geo, tokens))
    t = estimate_traffic(spec, tokens)
    predicted = t.saved_bytes / t.total_bytes_without_dedup
    # What differs: the KV page rounded to whole bytes a token (64 bytes of ~1 MB) and the aux rows.
    assert predicted == pytest.approx(sglang_reduction(geo, tokens), abs=1e-4)
    # State from CP rank 0 only, to each of the 8 decode ranks; 7 more copies skipped.
    assert t.state_bytes == 8 * geo.state_bytes(tokens)
    assert t.saved_bytes == 7 * t.state_bytes
    assert t.kv_bytes == 8 * math.ceil(tokens / 256) * 256 * 3899
    assert predicted < 7 / 8


def test_the_reduction_falls_with_the_prompt_and_crosses_the_seeds_figure(geo: V4Geometry) -> None:
    one_window = [sglang_reduction(geo, 256 * p) for p in range(1, 9)]  # L a page multiple: one window page
    assert one_window == sorted(one_window, reverse=True)
    assert one_window[0] > 0.8497 > one_window[-1]
    assert sglang_reduction(geo, 131072) < 0.2  # long prompts: KV dwarfs the window's state


def test_other_layer_patterns_shift_the_figure(geo: V4Geometry) -> None:
    fewer = from_sglang([0] * 3 + [4] * 40)
    assert fewer.n128 == 0 and fewer.request_state == 0
    assert sglang_reduction(fewer, 1024) != sglang_reduction(geo, 1024)
    assert default_ratios(5) == [0, 0, 4, 128, 4]


def test_typed_state_tensors_need_not_be_equal_or_sum_to_a_multiple_of_their_count() -> None:
    spec = pdcluster().model(stateTensorBytes=[3, 5, 7]).spec()
    assert spec.model.state_bytes_per_request == 15 and spec.model.state_layers == 3
