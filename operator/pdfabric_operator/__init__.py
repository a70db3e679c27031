"""The pdfabric operator: places PDCluster agents on GPU nodes (kopf).

Layers (enforced by .importlinter): main/handlers (kopf glue) -> reconcile/kube (API I/O) ->
planner, builders, status (pure: no kopf, no kubernetes client).
"""
