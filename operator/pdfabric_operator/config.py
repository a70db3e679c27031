"""Operator settings from PDFABRIC_* environment variables, checked once at start.

PDFABRIC_RECONCILE_INTERVAL  seconds between level-based reconciles of one PDCluster (default 20)
PDFABRIC_RESYNC_INTERVAL     seconds between reconciles of a PDCluster that is satisfied (Ready as asked, nothing
                             to report) and runs no engines: events wake it, this only catches drift in the
                             children no watch covers (default 300; never below the reconcile interval)
PDFABRIC_PEERING             kopf peering object (ClusterKopfPeering) name; "" runs standalone (default pdfabric)
PDFABRIC_PRIORITY            peering priority; unset draws a random one, so of two replicas exactly one acts
PDFABRIC_PEERING_LIFETIME    seconds a silent peer counts as alive (default 60): the failover delay
PDFABRIC_METRICS_PORT        Prometheus metrics port, 0 disables (default 8080)
PDFABRIC_WATCH_TIMEOUT       server-side watch timeout in seconds (default 300)
PDFABRIC_KUBECONFIG          kubeconfig to use instead of in-cluster credentials or $KUBECONFIG
PDFABRIC_LIVENESS            liveness endpoint URL (default http://0.0.0.0:8081/healthz)
PDFABRIC_VERBOSE             non-empty: debug logging
PDFABRIC_NETWORK_POLICY      "false": build no NetworkPolicy per PDCluster (and delete one built before) (default true)
PDFABRIC_MONITORING_NAMESPACE  the namespace whose pods may reach the agents' metrics port; "" any (default "")
PDFABRIC_NAMESPACE           the operator's own namespace (the chart sets it): its pods may reach the agents' metrics port too (/readyz, agentstate.py)
PDFABRIC_PEER_CERT_VALIDITY_S  seconds an agent's peer certificate is valid; it is issued anew two thirds through (default 31536000: 365 days; at least 60)
PDFABRIC_GROUP_BIND_TIMEOUT  seconds a pod of a replica over several nodes may stay unschedulable before its whole group is released (deleted, created again after a doubling hold) (default 300)
PDFABRIC_AGENT_ADDRESSES     a JSON file {agent pod name: "host:port"} read in place of pod IP and metrics port (local runs, hack/pdfabric_devcluster) (default "")
"""

from __future__ import annotations

import datetime
import os
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class OperatorConfig:
    reconcile_interval: float = 20.0
    resync_interval: float = 300.0
    peering: str = "pdfabric"
    priority: int = 0
    metrics_port: int = 8080
    watch_timeout: int = 300
    peering_lifetime: int = 60
    network_policy: bool = True
    monitoring_namespace: str = ""
    namespace: str = ""
    agent_addresses: str = ""
    peer_cert_validity: datetime.timedelta = datetime.timedelta(days=365)
    group_bind_timeout: float = 300.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorConfig:
        env = os.environ if env is None else env

        def number(key: str, default: float, low: float) -> float:
            raw = env.get(key, "")
            try:
                value = float(raw) if raw else default
            except ValueError as exc:
                raise ConfigError(f"{key} must be a number, got {raw!r}") from exc
            if value < low:
                raise ConfigError(f"{key} must be at least {low}, got {value}")
            return value

        priority_raw = env.get("PDFABRIC_PRIORITY", "")
        try:
            # Random by default: kopf pauses *all* peers of equal priority, so replicas must differ.
            priority = int(priority_raw) if priority_raw else random.SystemRandom().randint(1, 2**30)
        except ValueError as exc:
            raise ConfigError(f"PDFABRIC_PRIORITY must be an integer, got {priority_raw!r}") from exc
        network_policy_raw = env.get("PDFABRIC_NETWORK_POLICY", "true").lower()
        if network_policy_raw not in ("true", "false"):
            raise ConfigError(f"PDFABRIC_NETWORK_POLICY must be true or false, got {network_policy_raw!r}")
        monitoring_namespace = env.get("PDFABRIC_MONITORING_NAMESPACE", "")
        if monitoring_namespace and not _DNS_LABEL.fullmatch(monitoring_namespace):
            raise ConfigError(f"PDFABRIC_MONITORING_NAMESPACE must be a namespace name, got {monitoring_namespace!r}")
        namespace = env.get("PDFABRIC_NAMESPACE", "")
        if namespace and not _DNS_LABEL.fullmatch(namespace):
            raise ConfigError(f"PDFABRIC_NAMESPACE must be a namespace name, got {namespace!r}")
        reconcile_interval = number("PDFABRIC_RECONCILE_INTERVAL", 20.0, 0.1)
        return cls(
            reconcile_interval=reconcile_interval,
            resync_interval=max(reconcile_interval, number("PDFABRIC_RESYNC_INTERVAL", 300.0, 0.1)),
            peering=env.get("PDFABRIC_PEERING", "pdfabric"),
            priority=priority,
            metrics_port=int(number("PDFABRIC_METRICS_PORT", 8080, 0)),
            watch_timeout=int(number("PDFABRIC_WATCH_TIMEOUT", 300, 1)),
            peering_lifetime=int(number("PDFABRIC_PEERING_LIFETIME", 60, 1)),
            network_policy=network_policy_raw == "true",
            monitoring_namespace=monitoring_namespace,
            namespace=namespace,
            agent_addresses=env.get("PDFABRIC_AGENT_ADDRESSES", ""),
            peer_cert_validity=datetime.timedelta(seconds=number("PDFABRIC_PEER_CERT_VALIDITY_S", 31536000, 60)),
            group_bind_timeout=number("PDFABRIC_GROUP_BIND_TIMEOUT", 300.0, 1),
        )
