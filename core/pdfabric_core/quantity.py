"""Kubernetes resource quantities, exactly (Decimal): parsed, added, written back.

The operator adds the resources of one node pod's parts (the agent's and each engine's) into the
one container that runs them all; a sum must say what the parts said, to the unit. The grammar is
Kubernetes' (k8s.io/apimachinery resource.Quantity): a signed decimal number, then a binary suffix
(Ki Mi Gi Ti Pi Ei), a decimal one (n u m "" k M G T P E) or an exponent (e3, E-2).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from decimal import Decimal, InvalidOperation

__all__ = ["QUANTITY_PATTERN", "QuantityError", "add_quantities", "format_quantity", "parse_quantity"]

_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
# The grammar as the CRD's schema spells it (a pattern on every quantity field; RE2 and Python alike).
QUANTITY_PATTERN = r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
_QUANTITY = re.compile(QUANTITY_PATTERN)


class QuantityError(ValueError):
    """Not a Kubernetes quantity."""


def parse_quantity(value: object) -> Decimal:
    """The quantity's value in base units ("1500m" -> 1.5, "2Gi" -> 2147483648); QuantityError if
    it is none (Kubernetes would refuse the pod)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise QuantityError(f"{value!r} is not a quantity")
    text = value if isinstance(value, str) else str(value)
    m = _QUANTITY.match(text)
    if m is None:
        raise QuantityError(f"{value!r} is not a quantity (a number with an optional suffix: 500m, 2, 4Gi, 1e3)")
    try:
        number = Decimal(text[: m.start(3)] if m.group(3) else text)
    except InvalidOperation:  # pragma: no cover - the pattern admits only decimal numbers
        raise QuantityError(f"{value!r} is not a quantity") from None
    suffix = m.group(3) or ""
    if suffix in _BINARY:
        return number * (Decimal(1024) ** _BINARY[suffix])
    if suffix in _DECIMAL:
        return number.scaleb(_DECIMAL[suffix])
    return number.scaleb(int(suffix[1:]))  # exponent form


def _plain(value: Decimal) -> str:
    text = format(value.normalize(), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def format_quantity(value: Decimal, *, binary: bool = False, decimal: bool = False) -> str:
    """``value`` written exactly and short: the largest binary suffix that divides it when
    ``binary`` (2560Mi), else the largest decimal one when ``decimal`` (3G), else a plain number
    (3, 1500m for a whole number of thousandths, 0.0005 for the rest)."""
    if value == value.to_integral_value():
        whole = int(value)
        if whole and binary:
            for suffix, power in sorted(_BINARY.items(), key=lambda x: -x[1]):
                if whole % (1024**power) == 0:
                    return f"{whole // 1024**power}{suffix}"
        if whole and decimal:
            for suffix, power in sorted(_DECIMAL.items(), key=lambda x: -x[1]):
                if power > 0 and whole % (10**power) == 0:
                    return f"{whole // 10**power}{suffix}"
        return str(whole)
    milli = value.scaleb(3)
    if milli == milli.to_integral_value():
        return f"{int(milli)}m"
    return _plain(value)


def add_quantities(values: Iterable[object]) -> str:
    """The exact sum of Kubernetes quantities, as a quantity (binary suffixes when any addend had
    one: "2Gi" + "512Mi" = "2560Mi"; "1" + "500m" = "1500m")."""
    total = Decimal(0)
    binary = decimal = False
    for v in values:
        total += parse_quantity(v)
        text = str(v)
        binary = binary or text.endswith("i")
        decimal = decimal or text[-1:] in ("k", "M", "G", "T", "P", "E")
    return format_quantity(total, binary=binary, decimal=decimal)
