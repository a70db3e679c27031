"""SGLang's real server on a CPU machine, for tests and the demo: a small random-weight Llama's model
directory (``model``), the servers' command lines and processes (``servers``), the ``sgl_kernel``
test stand-in (``standin/``) and the CPU switches of the engines' own backends, the controls (``hack/controls_cpu/``)."""
