"""The kernel source compiles for Hopper with NVRTC (CPU-only); skipped where NVRTC is absent.
The launch's persistent grid size, from the method the launch calls."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdfabric_agent.memory import cuda
from pdfabric_agent.transfer.fastpath.kernel import GatherScatterKernel, KernelConfig, compile_kernel


@pytest.mark.parametrize(
    ("units", "threads", "blocks_per_sm", "grid"),
    [
        (8, 512, 2, 1),  # fewer units than one block's warps: one block
        (16, 512, 2, 1),  # exactly one block's 16 warps
        (17, 512, 2, 2),  # one unit more: a second block
        (10**6, 512, 2, 264),  # capped at what the machine holds resident (132 SMs x 2)
        (10**6, 512, 1, 132),
        (0, 512, 1, 1),  # never an empty launch
    ],
    ids=["small", "one-block", "one-more", "capped-2-per-sm", "capped-1-per-sm", "no-units"],
)
def test_grid_is_persistent_and_covers_small_requests(units: int, threads: int, blocks_per_sm: int, grid: int) -> None:
    # The real method on a stand-in for a loaded kernel on a 132-SM H200 (no GPU needed).
    kernel = SimpleNamespace(cfg=KernelConfig(threads=threads, blocks_per_sm=blocks_per_sm), sms=132)
    assert GatherScatterKernel.grid(kernel, units) == grid  # type: ignore[arg-type]


def _nvrtc() -> None:
    try:
        cuda._load_nvrtc()
    except cuda.CudaError as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("unroll", [4, 8])
def test_kernel_builds_with_wide_accesses_and_no_local_memory(unroll: int) -> None:
    _nvrtc()
    ptx = compile_kernel("sm_90", KernelConfig(unroll=unroll), cubin=False).decode()
    assert ptx.count("ld.global.nc.L1::no_allocate.v4.u32") >= unroll
    assert ptx.count("st.global.v4.u32") >= unroll
    assert "st.release.sys" in ptx  # completion flag published with release semantics
    assert ".local" not in ptx  # no spills: the unrolled registers stay registers
    assert "pdf_gather_scatter_small" in ptx
