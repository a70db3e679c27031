"""pdfabric node agent: owns the transfer engines and registered pools of the ranks on its node.

Layers, top to bottom: ``main`` (process wiring) -> ``server`` (HTTP API, auth) -> ``agent``
(rooms, request state machine, peers) -> ``plan`` (pure: requests -> blocks, using
``pdfabric_core.policy``) -> ``backend`` (the TransferBackend protocol; Mooncake, MORI).
"""
