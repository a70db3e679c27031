"""pdfabric node agent: owns the transfer engines and registered memory of the ranks on its node.

One package per concern; their layers, top to bottom, are written once, as the import contract
``agent-layers`` in ``.importlinter`` (``make lint`` enforces it): ``process`` > ``engines`` |
``node`` | ``http`` | ``client`` > ``rooms`` > ``peers`` | ``ranks`` > ``transfer`` | ``runtime`` >
``protocol`` > ``memory``. docs/agent.md's code map lists every module.
"""
