"""hack/render_panels.py plots each traffic panel's own queries, with the variables set."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gen_dashboards
import render_panels


def test_traffic_panels_render_from_their_queries(tmp_path: Path) -> None:
    asked: list[str] = []

    def query(expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        asked.append(expr)
        values = [[start + i, str(i * 1024.0)] for i in range(int((end - start) / step) + 1)]
        return [{"metric": {"kind": "kv", "rank": "pd-prefill-0/0", "peer": "pd-decode-0"}, "values": values}]

    drawn = render_panels.render(query, 1000.0, 1030.0, tmp_path, pdcluster="pd", namespace="ns")
    assert set(drawn) == {f"panel-{render_panels.slug(t)}.png" for t in render_panels.TRAFFIC_PANELS}
    for name, series in drawn.items():
        assert series >= 1
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    panels = {p.title: p for p in gen_dashboards.TRANSFER_PANELS}
    want = [
        gen_dashboards.concrete(e, rate="5s", pdcluster="pd", namespace="ns")
        for t in render_panels.TRAFFIC_PANELS
        for e, _ in panels[t].exprs
    ]
    assert asked == want


def test_legend_and_units() -> None:
    assert render_panels.legend("{{rank}} -> {{peer}}", {"rank": "r0", "peer": "d1"}) == "r0 -> d1"
    assert render_panels.scaled("Bps")(3 * 2**20) == "3 MiB/s"
    assert render_panels.scaled("s")(0.0042) == "4.2 ms"
