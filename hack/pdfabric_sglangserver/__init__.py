"""SGLang's real server on a CPU machine, for tests and the demo: a small random-weight Llama's model
directory (``model``), the servers' command lines and processes (``servers``), the ``sgl_kernel``
test stand-in (``standin/``) and the Mooncake control's CPU switch (``mooncake_cpu/``)."""
