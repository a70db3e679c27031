"""TEST HARNESS: lets SGLang's own Mooncake backend (the control in tests/sglang) run on a CPU-only
machine. Its sender's host-tensor-indices path pins host memory and records a ``torch.cuda.Event``
(prefill.py:1753), which a machine without CUDA cannot do; with the flag off the sender takes the
plain path SGLang uses for every other backend. Applied when the module is first imported, in
whichever SGLang process imports it; nothing else is touched."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

TARGET = "sglang.srt.disaggregation.mooncake.conn"


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            real_exec(module)
            module.MooncakeKVSender.supports_host_tensor_indices = False

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _AfterImport())
