"""TEST HARNESS: vLLM's NixlConnector (the control of the vLLM server tests) on a CPU machine with
NIXL's progress thread waiting for UCX's events instead of polling. NIXL's Python API starts that
thread with a delay of 0, under which it polls without waiting; on this 2-core machine a control
pair's polling threads kept both cores busy with no request, which slowed everything beside them
and once ran out vLLM's own 5 s handshake (docs/testing.md, run 16). pdfabric's agents run NIXL the
same way (agent ``transfer/nixl_setup.waiting_agent``). The API has no argument for the delay: the
binding's config class keeps it, once NIXL's module is imported, in whichever process imports it;
nothing else is touched."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

PROGRESS_DELAY_US = 1000
TARGETS = ("nixl_cu13._api", "nixl_cu12._api")


def waiting_progress_thread(api: ModuleType) -> None:
    binding = api.nixlBind
    base = binding.nixlAgentConfig

    class WaitingConfig(base):  # type: ignore[misc, valid-type]
        def __setattr__(self, key: str, value: Any) -> None:
            super().__setattr__(key, PROGRESS_DELAY_US if key == "pthrDelay" else value)

    binding.nixlAgentConfig = WaitingConfig


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            real_exec(module)
            waiting_progress_thread(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if __name__ == "sitecustomize":
    sys.meta_path.insert(0, _AfterImport())
