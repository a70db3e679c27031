"""pdfabric as an SGLang transfer backend (``--disaggregation-transfer-backend pdfabric``).

Installed with ``pdfabric[sglang]``, SGLang's ``load_plugins()`` finds ``plugin.register`` through
the ``sglang.srt.plugins`` entry point; the classes in ``conn`` then move SGLang's own KV, state and
aux buffers through the node's pdfabric agent. docs/sglang.md is the user's page.
"""
