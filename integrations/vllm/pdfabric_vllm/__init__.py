"""pdfabric as a vLLM v1 KV connector: vLLM's prefill and decode servers move their KV through the
node's pdfabric agent (``--kv-transfer-config '{"kv_connector": "PdfabricConnector",
"kv_connector_module_path": "pdfabric_vllm.connector", "kv_role": "kv_producer"}'``, or
``kv_consumer`` on decode). docs/vllm.md is the user's page.

``connector`` is the class vLLM loads; it hands each call to the ``scheduler`` side (in vLLM's engine
core) or the ``worker`` side (one per TP rank, which registers the rank's KV with its agent); what
goes between them each step is ``orders``; what travels in a request's ``kv_transfer_params`` is
``params``; how the agent reaches vLLM's KV cache is ``memory``.
"""
