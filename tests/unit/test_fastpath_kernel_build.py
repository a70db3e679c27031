"""The kernel source compiles for Hopper with NVRTC (CPU-only); skipped where NVRTC is absent."""

from __future__ import annotations

import pytest

from pdfabric_agent.fastpath import cuda
from pdfabric_agent.fastpath.kernel import KernelConfig, compile_kernel


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
