"""Parsing a stored PDCluster `.spec` (camelCase JSON) into the model's dataclasses: a field the
spec leaves out keeps its dataclass default, so the defaults live in the dataclasses alone."""

from __future__ import annotations

import enum
import types
from collections.abc import Mapping
from dataclasses import MISSING, Field, fields, is_dataclass, replace
from typing import Any, Union, get_args, get_origin, get_type_hints

from pdfabric_core.spec.model import NONE_VALUE_KEY, OWN_PARSER_KEY, ModelGeometry, PDClusterSpec, SpecError
from pdfabric_core.spec.serving import (
    DecodeEngineSpec,
    EngineSandbox,
    EngineSpec,
    PodOverrides,
    PrefillEngineSpec,
    RouterSpec,
)
from pdfabric_core.spec.validate import validate_spec


def crd_key(name: str) -> str:
    """The CRD's (camelCase) key of a spec dataclass field: max_gpus_per_node -> maxGpusPerNode."""
    first, *rest = name.split("_")
    return first + "".join(word.capitalize() for word in rest)


def _convert(tp: Any, value: Any, where: str) -> Any:
    """`value` as stored (JSON) turned into the field type `tp`."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        (inner,) = [a for a in get_args(tp) if a is not type(None)]
        return _convert(inner, value, where)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            allowed = ", ".join(str(m.value) for m in tp)
            raise ValueError(f"{where} must be one of {allowed}, got {value!r}") from None
    if origin is tuple:
        return tuple(_convert(get_args(tp)[0], x, where) for x in value)
    if origin is not None and issubclass(origin, Mapping):
        return dict(value)
    if tp in (bool, int, float, str):
        return tp(value)
    raise TypeError(f"{where}: no parser for field type {tp!r}")


_HINTS: dict[type[Any], dict[str, Any]] = {}


def _hints(cls: type[Any]) -> dict[str, Any]:
    """The resolved field types of `cls` (annotations are strings here), computed once."""
    if cls not in _HINTS:
        _HINTS[cls] = get_type_hints(cls)
    return _HINTS[cls]


def _parse_fields(cls: type[Any], raw: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """Keyword arguments for dataclass `cls` from its stored section: a field that is absent (or
    null) keeps the dataclass default, so the defaults live in the dataclasses alone."""
    hints = _hints(cls)
    out: dict[str, Any] = {}
    for f in fields(cls):
        if is_dataclass(hints[f.name]) or OWN_PARSER_KEY in f.metadata:
            continue
        value = raw.get(crd_key(f.name))
        if value is None:
            continue
        if NONE_VALUE_KEY in f.metadata and value == f.metadata[NONE_VALUE_KEY]:
            out[f.name] = None
            continue
        out[f.name] = _convert(hints[f.name], value, f"{prefix}{crd_key(f.name)}")
    return out


def field_default(f: Field[Any]) -> Any:
    """A dataclass field's default value (calling its default_factory)."""
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    raise LookupError(f"field {f.name} has no default")


def parse_spec(raw: Mapping[str, Any]) -> PDClusterSpec:
    """Parse a PDCluster `.spec` (camelCase, as stored) and check the cross-field rules.

    Every field the spec leaves out takes its dataclass default (equal to the CRD's, which a unit
    test checks). Raises SpecError naming the field and what to change.
    """
    try:
        top = _parse_fields(PDClusterSpec, raw, "")
        hints = _hints(PDClusterSpec)
        for f in fields(PDClusterSpec):
            section = hints[f.name]
            if isinstance(section, type) and is_dataclass(section):
                top[f.name] = section(**_parse_fields(section, raw.get(crd_key(f.name)) or {}, f"{crd_key(f.name)}."))
        top["agent"] = replace(top["agent"], pod=_parse_pod((raw.get("agent") or {}).get("pod"), "agent.pod."))
        top["engine"] = _parse_engine(raw.get("engine"))
        top["router"] = _parse_router(raw.get("router"))
        top["model"] = typed_state(top["model"])
        spec = PDClusterSpec(**top)
    except (ValueError, TypeError) as exc:
        raise SpecError(f"invalid PDCluster spec: {exc}") from exc
    validate_spec(spec)
    return spec


def typed_state(model: ModelGeometry) -> ModelGeometry:
    """``model`` with stateLayers and stateBytesPerRequest derived from stateTensorBytes (one state
    tensor a layer entry); ValueError where given values disagree with it."""
    tensors = model.state_tensor_bytes
    if not tensors:
        return model
    total = sum(tensors)
    if model.state_bytes_per_request not in (0, total) or model.state_layers not in (1, len(tensors)):
        raise ValueError(
            f"model.stateBytesPerRequest {model.state_bytes_per_request} and stateLayers {model.state_layers} "
            f"disagree with model.stateTensorBytes {list(tensors)} (sum {total}, {len(tensors)} tensors): "
            "leave them out, they follow from stateTensorBytes"
        )
    return replace(model, state_bytes_per_request=total, state_layers=len(tensors))


def _parse_engine(raw: Any) -> EngineSpec | None:
    """spec.engine, or None when it is left out (the section has no defaults of its own)."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ValueError(f"engine must be an object, got {raw!r}")
    if not raw.get("image"):
        raise ValueError("engine.image is required (the engine image)")
    for role in ("prefill", "decode"):
        if not isinstance(raw.get(role), Mapping):
            raise ValueError(f"engine.{role} is required (its command)")
    return EngineSpec(
        image=str(raw["image"]),
        prefill=PrefillEngineSpec(**_parse_fields(PrefillEngineSpec, raw["prefill"], "engine.prefill.")),
        decode=DecodeEngineSpec(**_parse_fields(DecodeEngineSpec, raw["decode"], "engine.decode.")),
        shared_memory="" if raw.get("sharedMemory") is None else str(raw["sharedMemory"]),
        sandbox=_parse_sandbox(raw.get("sandbox")),
    )


def _parse_sandbox(raw: Any) -> EngineSandbox:
    if raw is None:
        return EngineSandbox.BEST_EFFORT
    try:
        return EngineSandbox(raw)
    except ValueError:
        raise ValueError(f"engine.sandbox must be one of {', '.join(EngineSandbox)}, got {raw!r}") from None


def _parse_router(raw: Any) -> RouterSpec | None:
    """spec.router, or None when it is left out."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ValueError(f"router must be an object, got {raw!r}")
    if not raw.get("image"):
        raise ValueError(
            "router.image is required (an image with the router of router.kind: sglang-router or vllm-router)"
        )
    return RouterSpec(
        image=str(raw["image"]),
        pod=_parse_pod(raw.get("pod"), "router.pod."),
        **_parse_fields(RouterSpec, {k: v for k, v in raw.items() if k != "image"}, "router."),
    )


def _parse_pod(raw: Any, prefix: str) -> PodOverrides:
    if raw is None:
        return PodOverrides()
    if not isinstance(raw, Mapping):
        raise ValueError(f"{prefix[:-1]} must be an object, got {raw!r}")
    return PodOverrides(**_parse_fields(PodOverrides, raw, prefix))
