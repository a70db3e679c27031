"""How a NIXL agent is made on this node: the NIXL backend plugin per transport (UCX, or LIBFABRIC
for EFA), its library's settings (set before the first agent starts: UCX reads them once), the
network interface UCX's tcp transport listens on, and a NIXL agent whose progress thread waits for
events instead of polling (``waiting_agent``)."""

from __future__ import annotations

import fcntl
import socket
import struct
import sys
import threading
from collections.abc import Mapping
from typing import Any

from pdfabric_core.policy.types import Transport

UCX = "UCX"  # NIXL's UCX backend plugin: tcp, rdma, nvlink-intra (CUDA IPC)
# NIXL's libfabric backend plugin, for EFA. NIXL 1.5.1's plugin links libfabric.so.1, CUDA's runtime
# and hwloc: on a node without them NIXL answers "unsupported backend" (seen here, on CPU), which the
# backend reports; the agent's start refuses efa first on a node without an EFA device.
LIBFABRIC = "LIBFABRIC"
SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


# nvlink-intra: UCX's CUDA IPC moves GPU memory between processes of one node (cuda_ipc: the writer
# opens the peer's cudaIpcMemHandle and copies device to device); cuda_copy is what tells UCX a
# pointer is GPU memory at all; tcp carries what cuda_ipc cannot: UCX's wire-up and active messages
# (cuda_ipc has none), NIXL's notifications, and host-memory regions (the aux rows of memPool NONE).
# Seen on an H100 with NIXL 1.5.1's UCX 1.23 (benchmarks/results/gpu-2026-12-07-nixl.md): writes
# between the agents' own GPU pools take cuda_ipc (zero-copy); a destination the receiving process
# opened by CUDA IPC itself (an engine's buffer) has no IPC handle UCX can pass on, and UCX emulates
# those writes over tcp, byte-exact but slow. UCX's source also refuses legacy CUDA IPC handles
# between PID namespaces (not run here).
NVLINK_INTRA_TLS = "cuda_ipc,cuda_copy,tcp"


def plugin_of(transport: Transport) -> str:
    """The NIXL backend plugin that carries ``transport``."""
    return LIBFABRIC if transport is Transport.EFA else UCX


def library_env(transport: Transport, host: str = "") -> Mapping[str, str]:
    """The settings of the library under ``transport``'s plugin: libfabric's efa provider alone for
    EFA (libfabric would otherwise take any provider it finds, tcp among them), else ``ucx_env``."""
    if transport is Transport.EFA:
        return {"FI_PROVIDER": "efa"}
    return ucx_env(transport, host)


def ucx_env(transport: Transport, host: str = "") -> Mapping[str, str]:
    """UCX's settings for ``transport``, set before the first NIXL agent starts (UCX reads them
    once). tcp: UCX's tcp transport only, and without UCX's InfiniBand modules, which a node
    without RDMA devices does not need and whose libnl destructor crashed every process at exit.
    nvlink-intra: CUDA IPC for GPU memory with tcp beside it (``NVLINK_INTRA_TLS``), also without
    the InfiniBand modules. ``host``: the address peers reach this rank at; UCX's tcp transport then
    listens only on the interface that holds it (by default it listens on every interface)."""
    if transport is Transport.TCP or transport is Transport.NVLINK_INTRA:
        tls = "tcp" if transport is Transport.TCP else NVLINK_INTRA_TLS
        env = {"UCX_TLS": tls, "UCX_MODULES": "^ib"}
        if host and (device := interface_of(host)):
            env["UCX_NET_DEVICES"] = device
        return env
    if transport is Transport.RDMA:
        return {"UCX_TLS": "rc,ud,tcp"}
    raise ValueError(f"the nixl backend does not carry transport {transport.value}: use tcp, rdma or nvlink-intra")


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds IPv4 ``address``; None when none does."""
    try:
        packed = socket.inet_aton(address)
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on it
            if answer[20:24] == packed:
                return name
    return None


# NIXL's progress thread moves UCX's bytes, on the receiving side too (UCX over tcp writes into a
# receiver's memory only as its worker makes progress). NIXL's Python API starts it with a delay of 0,
# under which it polls without waiting: each idle rank took about half a core (two idle agents, 4.6 s
# of CPU in 5 s). With a delay it waits for UCX's events, at most this long: idle ranks took 1% of a
# core, and a 64 MiB write was no slower (tcp, loopback).
PROGRESS_DELAY_US = 1000
_config_lock = threading.Lock()


def waiting_agent(nixl_agent: Any, name: str, plugin: str = UCX) -> Any:
    """A NIXL agent (``plugin``'s backend, progress thread, no listener thread) whose progress thread waits
    for events (``PROGRESS_DELAY_US``). The Python API offers no argument for the delay but sets the
    binding's ``pthrDelay`` on a config it makes: for this one construction that config is a
    subclass of the binding's that keeps the delay."""
    from nixl._api import nixl_agent_config

    api = sys.modules[nixl_agent.__module__]
    binding = api.nixlBind
    base = binding.nixlAgentConfig

    class WaitingConfig(base):  # type: ignore[misc, valid-type]
        def __setattr__(self, key: str, value: Any) -> None:
            super().__setattr__(key, PROGRESS_DELAY_US if key == "pthrDelay" else value)

    config = nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False, backends=[plugin])
    with _config_lock:
        binding.nixlAgentConfig = WaitingConfig
        try:
            return nixl_agent(name, config)
        finally:
            binding.nixlAgentConfig = base
