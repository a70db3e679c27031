"""The PDCluster spec as typed, validated Python values, for the operator and the agent.

The CRD (crds/pdcluster.yaml) is the API's single source; this package parses the (defaulted) spec
and checks what the CRD's CEL checks. By concern:

- model.py: one frozen dataclass per section, with the CRD's defaults (`PDClusterSpec`);
- serving.py: those of what runs in the pods besides the agent (spec.engine, spec.router, the pod overrides);
- parse.py: a stored `.spec` -> `PDClusterSpec` (`parse_spec`), the CRD key of a field (`crd_key`);
- validate.py: the cross-field rules (`validate_spec`);
- pod_overrides.py: what users may add to the operator's pods, and what stays reserved.

The model, `parse_spec`, `validate_spec` and `SpecError` are the public surface, importable from
here; the rest is imported from its module.
"""

from pdfabric_core.spec.model import (
    DTYPE_BYTES,
    ENGINE_PORT_SPAN,
    AgentSpec,
    DecodeSpec,
    ModelGeometry,
    PDClusterSpec,
    PlacementSpec,
    PrefillSpec,
    SpecError,
    TransferSpec,
)
from pdfabric_core.spec.parse import parse_spec
from pdfabric_core.spec.serving import (
    DecodeEngineSpec,
    EngineRoleSpec,
    EngineSandbox,
    EngineSpec,
    PodOverrides,
    PrefillEngineSpec,
    RouterKind,
    RouterSpec,
)
from pdfabric_core.spec.validate import validate_spec

__all__ = [
    "DTYPE_BYTES",
    "ENGINE_PORT_SPAN",
    "AgentSpec",
    "DecodeEngineSpec",
    "DecodeSpec",
    "EngineRoleSpec",
    "EngineSandbox",
    "EngineSpec",
    "ModelGeometry",
    "PDClusterSpec",
    "PlacementSpec",
    "PodOverrides",
    "PrefillEngineSpec",
    "PrefillSpec",
    "RouterKind",
    "RouterSpec",
    "SpecError",
    "TransferSpec",
    "parse_spec",
    "validate_spec",
]
