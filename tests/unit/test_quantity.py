"""Kubernetes quantities, exactly: the sums the operator writes into a node pod's one container."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from pdfabric_core.quantity import QUANTITY_PATTERN, QuantityError, add_quantities, format_quantity, parse_quantity


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1", "1"),
        (2, "2"),
        ("500m", "0.5"),
        ("1.5", "1.5"),
        (".5", "0.5"),
        ("+3", "3"),
        ("1Ki", "1024"),
        ("2Gi", str(2 * 1024**3)),
        ("1.5Gi", str(3 * 1024**3 // 2)),
        ("1Ei", str(1024**6)),
        ("4k", "4000"),
        ("3M", "3000000"),
        ("2G", "2000000000"),
        ("1T", str(10**12)),
        ("1P", str(10**15)),
        ("2E", str(2 * 10**18)),
        ("100u", "0.0001"),
        ("5n", "0.000000005"),
        ("1e3", "1000"),
        ("12E-1", "1.2"),
        ("2E3", "2000"),
        ("1e+2", "100"),
    ],
)
def test_parse(text: object, value: str) -> None:
    assert parse_quantity(text) == Decimal(value)


@pytest.mark.parametrize("bad", ["", "Gi", "1GB", "one", "1 Gi", "1.2.3", "0x10", "1g", "--1", "1Ki2", None, True, [1]])
def test_unparsable_is_refused(bad: object) -> None:
    with pytest.raises(QuantityError, match="not a quantity"):
        parse_quantity(bad)


@pytest.mark.parametrize(
    ("parts", "total"),
    [
        (["1", "2"], "3"),
        (["1", "500m"], "1500m"),
        (["250m", "750m"], "1"),
        (["2Gi", "512Mi"], "2560Mi"),
        (["1Gi", "1Gi"], "2Gi"),
        (["512Mi", "512Mi"], "1Gi"),
        (["1G", "500M"], "1500M"),
        (["1G", "1G"], "2G"),
        (["1Gi", "1G"], str(1024**3 + 10**9)),
        (["1e3", "1"], "1001"),
        ([4, "4"], "8"),
        (["100u", "1"], "1.0001"),
        (["0"], "0"),
    ],
)
def test_add_is_exact(parts: list[object], total: str) -> None:
    assert add_quantities(parts) == total
    assert parse_quantity(total) == sum((parse_quantity(p) for p in parts), Decimal(0))


def test_format_round_trips() -> None:
    for value in ("0.001", "1.25", "1073741824", "3000"):
        d = Decimal(value)
        for binary in (False, True):
            for decimal in (False, True):
                assert parse_quantity(format_quantity(d, binary=binary, decimal=decimal)) == d


def test_add_refuses_a_bad_addend() -> None:
    with pytest.raises(QuantityError, match="'2 cores'"):
        add_quantities(["1", "2 cores"])


def test_the_crd_spells_the_same_grammar() -> None:
    """Every quantity field of the CRD carries the pattern the operator parses by (RE2 and Python alike)."""
    text = (Path(__file__).resolve().parents[2] / "crds" / "pdcluster.yaml").read_text()
    assert text.count("pattern: '^[+-]") == text.count("x-kubernetes-int-or-string: true") > 0
    assert text.count(f"pattern: '{QUANTITY_PATTERN}'") == text.count("x-kubernetes-int-or-string: true")
