"""The operator's start: its settings read and checked, kopf configured (our own finalizer and
bookkeeping prefix, watch timeouts, peering), the metrics server started; and the credentials kopf
and the reconciler share."""

from __future__ import annotations

import logging

import kopf
from prometheus_client import start_http_server

from pdfabric_operator import constants as c
from pdfabric_operator.config import OperatorConfig
from pdfabric_operator.kube import Kube, load_configuration
from pdfabric_operator.ledger import LEDGER
from pdfabric_operator.operator_state import STATE


def configure_operator(settings: kopf.OperatorSettings, logger: kopf.Logger) -> None:
    cfg = OperatorConfig.from_env()
    STATE.config = cfg
    # A fresh start, as a new process would have (tests restart the operator in-process).
    STATE.kube = None
    STATE.memory.clear()
    STATE.generations.clear()
    STATE.node_prints.clear()
    STATE.agent_pod_views.clear()
    STATE.roles.clear()
    STATE.role_generations.clear()
    LEDGER.clear()
    # Our own prefix for kopf's finalizer and bookkeeping, in annotations, not in status.
    settings.persistence.finalizer = c.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=c.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=c.GROUP, key="last-handled-configuration"
    )
    # A watch without a server-side timeout can hang forever on a silently dropped connection
    # (kopf docs, "Networking"); the client timeout must exceed the server's.
    settings.watching.server_timeout = cfg.watch_timeout
    settings.watching.client_timeout = cfg.watch_timeout + 30
    settings.watching.connect_timeout = 30
    settings.networking.request_timeout = 60
    settings.posting.level = logging.WARNING  # k8s Events only for problems, not every handler run
    if cfg.peering:
        settings.peering.name = cfg.peering
        settings.peering.clusterwide = True
        settings.peering.mandatory = True
        settings.peering.standalone = False
        settings.peering.priority = cfg.priority
        settings.peering.lifetime = cfg.peering_lifetime
    else:
        settings.peering.standalone = True
    if cfg.metrics_port and not STATE.metrics_started:
        start_http_server(cfg.metrics_port)
        STATE.metrics_started = True
    logger.info(f"pdfabric operator: peering={cfg.peering or 'standalone'} priority={cfg.priority}")


def connection_info() -> kopf.ConnectionInfo:
    """kopf and the reconciler use the same credentials (in-cluster, else $KUBECONFIG)."""
    cfg = load_configuration()
    STATE.kube = Kube.from_configuration(cfg)
    # The client stores "Bearer <token>" under BearerToken (older releases: authorization).
    auth = cfg.get_api_key_with_prefix("BearerToken", alias="authorization") or ""
    scheme, _space, token = auth.partition(" ")
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        scheme=scheme.capitalize() if token else None,
        token=token or None,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
    )
