"""Every API name, label, annotation and finalizer key the operator writes, in one place.

kopf persists handler ids and these keys in live objects: renaming one orphans existing state.
"""

from __future__ import annotations

GROUP = "pdfabric.dev"
VERSION = "v1alpha1"
PLURAL = "pdclusters"
KIND = "PDCluster"
API_VERSION = f"{GROUP}/{VERSION}"
# The per-role scaling adapter (roles.py): one per (PDCluster, role), behind the scale API.
ROLE_PLURAL = "pdroles"
ROLE_KIND = "PDRole"

FINALIZER = f"{GROUP}/finalizer"

# Labels on every child object; selectors and the pod index use them.
LABEL_APP = "app.kubernetes.io/name"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_CLUSTER = f"{GROUP}/cluster"
LABEL_CLUSTER_UID = f"{GROUP}/cluster-uid"
LABEL_NODE = f"{GROUP}/node"
APP_NAME = "pdfabric"
MANAGED_BY = "pdfabric-operator"
COMPONENT_AGENT = "agent"
COMPONENT_ROUTER = "router"  # spec.router's pods (a Deployment's, never in the agent pod index)
# On node pods that run engines of a role (spec.engine): the per-role Services select them.
LABEL_SERVES = {"prefill": f"{GROUP}/serves-prefill", "decode": f"{GROUP}/serves-decode"}
AGENT_CONTAINER = "agent"

# Annotations on agent pods: what they were built for, so drift is a string comparison.
ANN_RANKS = f"{GROUP}/ranks"
ANN_POD_HASH = f"{GROUP}/pod-hash"
ANN_RANKMAP_HASH = f"{GROUP}/rankmap-hash"
ANN_ROUTER_HASH = f"{GROUP}/router-hash"  # what spec.router's Deployment was built from
ANN_CONFIG_HASH = f"{GROUP}/config-hash"
# A replica over several nodes: its members' uids and restart counts once all ran (group_restarts.py).
ANN_GROUP_INCARNATION = f"{GROUP}/group-incarnation"
ANN_NODE = f"{GROUP}/node"  # the node the planner chose for an agent pod (bound later by the scheduler)
# On an agent's peer-tls Secret: the serial of the certificate in it (a new pod, a new serial).
ANN_CERT_SERIAL = f"{GROUP}/cert-serial"
LABEL_AGENT = f"{GROUP}/agent"

# Paths and env inside the agent pod: the contract with pdfabric_agent.process.main.
AGENT_COMMAND = "pdfabric-agent"
RANKMAP_DIR = "/etc/pdfabric"
RANKMAP_PATH = f"{RANKMAP_DIR}/rankmap.json"
TOKEN_KEY = "token"
ENGINE_TOKEN_DIR = f"{RANKMAP_DIR}/engine-token"
ENGINE_TOKEN_PATH = f"{ENGINE_TOKEN_DIR}/{TOKEN_KEY}"
PEER_TLS_DIR = f"{RANKMAP_DIR}/peer-tls"
HOME_DIR = "/var/lib/pdfabric/home"  # HOME of the node pods: an emptyDir (caches of the engines)
# kubernetes.io/tls Secret keys; the agent's protocol/tls.py reads the same names.
TLS_CERT_KEY = "tls.crt"
TLS_KEY_KEY = "tls.key"
TLS_CA_KEY = "ca.crt"
READINESS_PATH = "/readyz"
LIVENESS_PATH = "/healthz"

# Condition types on PDCluster status.
COND_READY = "Ready"
COND_PLACED = "Placed"
COND_TRANSPORT_READY = "TransportReady"
COND_DEGRADED = "Degraded"
# Every serving agent runs the rank map the operator wrote last (live membership); False names those behind.
COND_RANKMAP_CURRENT = "RankMapCurrent"
COND_ENGINES_READY = "EnginesReady"  # with spec.engine only: every engine of both roles Ready

# On PDRoles: the replicas the operator last saw equal in the PDRole and its PDCluster; a PDRole
# whose spec.replicas differs from it was scaled (kubectl scale, an HPA, KEDA).
ANN_SYNCED_REPLICAS = f"{GROUP}/synced-replicas"
LABEL_ROLE = f"{GROUP}/role"
# On a node pod: which of its PDCluster's PodDisruptionBudgets counts it (prefill, decode, or units
# for intra-node NVLink pods holding both); patched in place, not part of the pod's hash.
LABEL_DISRUPTION_BUDGET = f"{GROUP}/disruption-budget"
COND_SYNCED = "Synced"  # the PDRole's one condition: the PDCluster has its replicas
