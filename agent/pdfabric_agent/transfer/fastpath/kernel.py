"""The gather/scatter kernel: local pages in, the peer's pool (mapped through CUDA IPC) out.

One warp copies one unit (a chunk of at most CHUNK bytes of one page of one buffer) with UNROLL
16-byte loads in flight per lane before any store, so reads from local HBM hide their latency
and writes over NVLink stream as full 512-byte warp stores. A persistent grid walks the units in
order; each warp remembers its group, so finding a unit's group costs nothing amortised.

Completion: every thread fences at system scope, each block then bumps a counter; the last
block resets the counter and stores the request's sequence number to the flag with release
semantics. The flag lives in pinned shared memory the receiver polls (or any device address), so
the receiver learns of completion without a CPU round trip per page, and the data written before
the flag are visible to it once it sees the flag.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

from pdfabric_agent.memory import cuda
from pdfabric_agent.transfer.fastpath.table import SMALL_TABLE_WORDS

SOURCE = r"""
typedef long long i64;
typedef unsigned long long u64;

struct SmallTable { i64 w[SMALL_WORDS]; };

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ void st_global(uint4* p, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};"
               :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

__device__ __forceinline__ void copy_chunk(const char* src, char* dst, i64 len, int lane) {
  if (((((u64)src) | ((u64)dst) | ((u64)len)) & 15ull) == 0ull) {
    const uint4* s = (const uint4*)src;
    uint4* d = (uint4*)dst;
    const int nvec = (int)(len >> 4);
    uint4 r[UNROLL];
    if (nvec == UNROLL * 32) {
#pragma unroll
      for (int k = 0; k < UNROLL; ++k) r[k] = ld_stream(s + lane + 32 * k);
#pragma unroll
      for (int k = 0; k < UNROLL; ++k) st_global(d + lane + 32 * k, r[k]);
    } else {
#pragma unroll
      for (int k = 0; k < UNROLL; ++k) { int i = lane + 32 * k; if (i < nvec) r[k] = ld_stream(s + i); }
#pragma unroll
      for (int k = 0; k < UNROLL; ++k) { int i = lane + 32 * k; if (i < nvec) st_global(d + i, r[k]); }
    }
  } else {
    // Odd sizes (small aux rows) go byte by byte; they are tiny by construction.
    for (i64 i = lane; i < len; i += 32) dst[i] = src[i];
  }
}

__device__ __forceinline__ void run(const i64* table, int ngroups, u64 total_units,
                                    unsigned int* counter, u64* flag, u64 seq) {
  const int lane = threadIdx.x & 31;
  const u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const u64 nwarps = ((u64)gridDim.x * blockDim.x) >> 5;
  int g = 0;
  u64 g_start = 0, g_next = ngroups > 1 ? (u64)table[8] : total_units;
  u64 nchunks = (u64)table[3], npages = (u64)table[2];
  i64 item = table[4];
  const i64* bt = table + table[5];
  const i64* pt = table + table[6];
  for (u64 u = warp; u < total_units; u += nwarps) {
    while (u >= g_next) {  // units rise monotonically per warp: the group only moves forward
      ++g;
      const i64* gd = table + 8 * g;
      g_start = (u64)gd[0];
      g_next = g + 1 < ngroups ? (u64)table[8 * (g + 1)] : total_units;
      npages = (u64)gd[2]; nchunks = (u64)gd[3]; item = gd[4];
      bt = table + gd[5]; pt = table + gd[6];
    }
    u64 local = u - g_start, rest = local, chunk = 0;
    if (nchunks != 1) { rest = local / nchunks; chunk = local - rest * nchunks; }
    const u64 buf = rest / npages, page = rest - buf * npages;
    const i64 off = (i64)chunk * CHUNK;
    i64 len = item - off;
    if (len > CHUNK) len = CHUNK;
    const char* src = (const char*)(bt[2 * buf] + pt[2 * page] * item + off);
    char* dst = (char*)(bt[2 * buf + 1] + pt[2 * page + 1] * item + off);
    copy_chunk(src, dst, len, lane);
  }
  if (flag == 0) return;
  // Grid-barrier pattern (as cooperative groups do it): the block's threads meet at bar.sync,
  // then one thread fences at system scope, which orders every write of the block before what
  // that thread does next. A single-block launch (aux-sized requests) skips the counter.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    if (gridDim.x == 1 || atomicAdd(counter, 1u) == gridDim.x - 1) {
      if (gridDim.x != 1) {
        *counter = 0u;  // ready for the next launch on this stream
        __threadfence_system();
      }
      asm volatile("st.release.sys.global.u64 [%0], %1;" :: "l"(flag), "l"(seq) : "memory");
    }
  }
}

extern "C" __global__ void __launch_bounds__(THREADS, MINB)
pdf_gather_scatter(const i64* __restrict__ table, int ngroups, u64 total_units,
                   unsigned int* counter, u64* flag, u64 seq) {
  run(table, ngroups, total_units, counter, flag, seq);
}

extern "C" __global__ void __launch_bounds__(THREADS, MINB)
pdf_gather_scatter_small(const __grid_constant__ SmallTable t, int ngroups, u64 total_units,
                         unsigned int* counter, u64* flag, u64 seq) {
  run(t.w, ngroups, total_units, counter, flag, seq);
}
"""


class SmallTable(ctypes.Structure):
    _fields_ = [("w", ctypes.c_int64 * SMALL_TABLE_WORDS)]


@dataclass(frozen=True)
class KernelConfig:
    # Swept on 2x H200 (benchmarks/results/gpu-2026-11-30.md): 4 configs within 0.5% of each other;
    # this one was best at 4 and 64 KiB pages. 16 loads in flight per lane, 8 KiB chunks.
    unroll: int = 16  # 16-byte loads in flight per lane; chunk = unroll * 512 bytes
    threads: int = 512
    blocks_per_sm: int = 1

    @property
    def chunk_bytes(self) -> int:
        return self.unroll * 32 * 16


def compile_options(arch: str, cfg: KernelConfig) -> list[str]:
    return [
        f"-arch={arch}",
        "-std=c++17",
        f"-DUNROLL={cfg.unroll}",
        f"-DCHUNK={cfg.chunk_bytes}",
        f"-DTHREADS={cfg.threads}",
        f"-DMINB={cfg.blocks_per_sm}",  # caps registers so the persistent grid is all resident
        f"-DSMALL_WORDS={SMALL_TABLE_WORDS}",
    ]


def compile_kernel(arch: str, cfg: KernelConfig, *, cubin: bool = True) -> bytes:
    """NVRTC compile; CPU-only, so tests can check the source builds without a GPU."""
    return cuda.nvrtc_compile(SOURCE, "pdfabric_fastpath.cu", compile_options(arch, cfg), cubin=cubin)


class GatherScatterKernel:
    """The compiled kernel for one device and config (modules are per context)."""

    _cache: dict[tuple[int, KernelConfig], GatherScatterKernel] = {}
    _lock = threading.Lock()

    def __init__(self, device: int, cfg: KernelConfig) -> None:
        cuda.primary_context(device)
        major = cuda.device_attribute(device, cuda.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        minor = cuda.device_attribute(device, cuda.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        self.device = device
        self.cfg = cfg
        self.sms = cuda.device_attribute(device, cuda.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        self._module = cuda.module_load(compile_kernel(f"sm_{major}{minor}", cfg))
        self._fn = cuda.module_function(self._module, "pdf_gather_scatter")
        self._fn_small = cuda.module_function(self._module, "pdf_gather_scatter_small")
        # Launch arguments live here and are refilled per launch (cuLaunchKernel copies them), so
        # an aux-sized launch allocates nothing; the lock makes refill + launch atomic.
        self._launch_lock = threading.Lock()
        self._small = SmallTable()
        self._table = ctypes.c_uint64()
        self._tail = [ctypes.c_int(), ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()]
        self._params_small = cuda.kernel_params([self._small, *self._tail])
        self._params = cuda.kernel_params([self._table, *self._tail])

    @classmethod
    def get(cls, device: int, cfg: KernelConfig) -> GatherScatterKernel:
        with cls._lock:
            key = (device, cfg)
            if key not in cls._cache:
                cls._cache[key] = cls(device, cfg)
            return cls._cache[key]

    def grid(self, total_units: int) -> int:
        warps = self.cfg.threads // 32
        return max(1, min(-(-total_units // warps), self.sms * self.cfg.blocks_per_sm))

    def launch(
        self,
        *,
        table_ptr: int,
        small_words: list[int] | None,
        ngroups: int,
        total_units: int,
        stream: int,
        counter_ptr: int,
        flag_ptr: int,
        seq: int,
    ) -> None:
        grid = self.grid(total_units)
        with self._launch_lock:
            t = self._tail
            t[0].value, t[1].value, t[2].value, t[3].value, t[4].value = (
                ngroups,
                total_units,
                counter_ptr,
                flag_ptr,
                seq,
            )
            cuda.primary_context(self.device)  # torch may have switched devices on this thread
            if small_words is not None:
                self._small.w[: len(small_words)] = small_words
                cuda.launch_params(self._fn_small, grid, self.cfg.threads, stream, self._params_small)
            else:
                self._table.value = table_ptr
                cuda.launch_params(self._fn, grid, self.cfg.threads, stream, self._params)
