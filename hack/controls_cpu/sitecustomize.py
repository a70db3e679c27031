"""TEST HARNESS: lets the engines' own transfer backends (the controls in the server tests: SGLang's
Mooncake and NIXL backends, vLLM's NixlConnector) run on a CPU-only machine. Each change is applied
when its module is first imported, in whichever engine process imports it; nothing else is touched.

- Mooncake: its sender's host-tensor-indices path pins host memory and records a
  ``torch.cuda.Event`` (prefill.py:1753), which a machine without CUDA cannot do; with the flag off
  the sender takes the plain path SGLang uses for every other backend.
- NIXL: SGLang registers KV it was not told the kind of as ``VRAM`` (``_normalize_kv_mem_kinds``);
  on CPU the KV is host memory and UCX refuses it as VRAM ("VRAM memory is detected as host by
  UCX ... VRAM registration cannot proceed"), which ends the scheduler. Here every KV kind is
  ``DRAM``, as SGLang itself declares host KV (its decode host offload does), on both sides and in
  what decode sends prefill.
- NIXL itself (under SGLang's NIXL backend and vLLM's NixlConnector): its Python API starts its
  progress thread with a delay of 0, under which it polls without waiting: a SGLang prefill and
  decode pair took both cores of this machine with no request (19.9 s of CPU in 10 s; 0.7 s with
  the change), a vLLM pair 15.8 s (1.7 s). With a delay the thread waits for UCX's events, as
  pdfabric's agents run NIXL (``nixl_setup.waiting_agent``); the binding's config class keeps it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any


def _mooncake(module: ModuleType) -> None:
    module.MooncakeKVSender.supports_host_tensor_indices = False


def _nixl(module: ModuleType) -> None:
    normalize, unpack = module._normalize_kv_mem_kinds, module._unpack_kv_mem_kinds

    def host(kinds: list[str]) -> list[str]:
        return ["DRAM"] * len(kinds)

    module._normalize_kv_mem_kinds = lambda kinds, expected_len: host(normalize(kinds, expected_len))
    module._unpack_kv_mem_kinds = lambda buf, expected_len: host(unpack(buf, expected_len))


PROGRESS_DELAY_US = 1000


def _waiting_progress_thread(api: ModuleType) -> None:
    binding = api.nixlBind
    base = binding.nixlAgentConfig

    class WaitingConfig(base):  # type: ignore[misc, valid-type]
        def __setattr__(self, key: str, value: Any) -> None:
            super().__setattr__(key, PROGRESS_DELAY_US if key == "pthrDelay" else value)

    binding.nixlAgentConfig = WaitingConfig


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "sglang.srt.disaggregation.mooncake.conn": _mooncake,
    "sglang.srt.disaggregation.nixl.conn": _nixl,
    "nixl_cu13._api": _waiting_progress_thread,
    "nixl_cu12._api": _waiting_progress_thread,
}


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        patch = PATCHES.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            real_exec(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def apply(module: ModuleType) -> None:
    """The change for ``module`` (one of ``PATCHES``), for a process that imported it already."""
    PATCHES[module.__name__](module)


if __name__ == "sitecustomize":  # as the servers' sitecustomize; a harness that loads it calls ``apply``
    sys.meta_path.insert(0, _AfterImport())
