#!/usr/bin/env bash
# One call on the GPU machine (the device tool, kind nvidia-h200-x2), from the repo root, with the
# Mooncake CUDA engine carried in .gpu-deps (fetched there with the gpu-deps tool: `gpu-deps fetch .gpu-deps`),
# and the pure-Python wheels the GPU machine's Python lacks in .gpu-deps/wheels (the test harness's
# certificates need cryptography: `pip download cryptography cffi pycparser --python-version 3.12
# --only-binary=:all: --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .gpu-deps/wheels`):
#   bash benchmarks/gpu/run.sh [tests] [fastpath] [agent] [tcp] [dmabuf] [chunks] [vllm] [nixl]      (default: the first three)
# (tcp: engine GPU KV over tcp, its benchmark then its GPU tests; one GPU is enough)
# (dmabuf: engine GPU memory exported as dma-bufs and handed over, its GPU tests with their prints; one GPU)
# (chunks: the transfer a chunked prefill leaves exposed after its last chunk, kernel path; one GPU)
# (nixl: GPU memory between two agent processes over NIXL, UCX's CUDA IPC, its GPU tests, then its
#  benchmark beside Mooncake and raw NIXL; one GPU. NIXL and Mooncake's engine together are too
#  large for one call beside .gpu-deps: carry .gpu-nixl instead, made with
#  `bash benchmarks/gpu/nixl_pack.sh build .gpu-nixl`, which holds Mooncake's engine, the debs and
#  the wheels too)
# Output goes to stdout and, when the device tool sets $OUT, into files there.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$(mktemp -d)}
export OUT
if [[ -d .gpu-deps ]]; then eval "$(.gpu-deps/gpu-deps load .gpu-deps)"; fi
if [[ -d .gpu-nixl ]]; then eval "$(bash benchmarks/gpu/nixl_pack.sh load .gpu-nixl)"; fi
if compgen -G ".gpu-deps/wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --break-system-packages --root-user-action=ignore .gpu-deps/wheels/*.whl
fi
steps=${*:-tests fastpath agent}
echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
nvidia-smi topo -m | head -4
python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__)'
rc=0
for step in $steps; do
  echo "== $step $(date -u +%T)"
  case $step in
    tests) python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu-tests.txt" | tail -25 || rc=1 ;;
    fastpath) python3 benchmarks/gpu/fastpath_bench.py 2>&1 | tee "$OUT/fastpath_bench.txt" | tail -40 || rc=1 ;;
    agent) python3 benchmarks/gpu/agent_request.py 2>&1 | tee "$OUT/agent_request.txt" | tail -40 || rc=1 ;;
    tcp)
      timeout 240 python3 benchmarks/gpu/tcp_gpu_bench.py 2>&1 | tail -40 || rc=1
      PDFABRIC_GPU_RESULTS=$OUT timeout 330 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_engine_tcp_gpu.py 2>&1 \
        | tee "$OUT/gpu-tcp-tests.txt" | tail -40 || rc=1 ;;
    dmabuf)
      timeout 300 python3 -m pytest -q -s -p no:cacheprovider -rs tests/gpu/test_dmabuf_gpu.py 2>&1 \
        | tee "$OUT/gpu-dmabuf-tests.txt" | tail -40 || rc=1 ;;
    chunks) timeout 400 python3 benchmarks/gpu/chunk_exposed.py --json "$OUT/chunk_exposed.json" 2>&1 | grep -v ' INFO \|^[IW][0-9]' \
        | tee "$OUT/chunk_exposed.txt" | tail -30 || rc=1 ;;
    vllm)  # vLLM's connector worker side, its KV cache on the GPU (no vLLM needed: it builds vLLM's layout)
      PDFABRIC_GPU_RESULTS=$OUT timeout 300 python3 -m pytest -q -s -p no:cacheprovider -rs tests/gpu/test_vllm_connector_gpu.py 2>&1 \
        | tee "$OUT/gpu-vllm-tests.txt" | tail -40 || rc=1 ;;
    nixl)  # issue 43: the GPU tests (the engine-buffer case as the agent is, then with NIXL's backend
      # saying it moves GPU memory: tests/gpu/test_nixl_gpu.py's docstring), then the benchmark
      # (NIXL_BENCH_ARGS: its arguments, e.g. --cases nixl mooncake-engine; NIXL_BENCH_TIMEOUT: seconds)
      PDFABRIC_GPU_RESULTS=$OUT timeout 90 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_nixl_gpu.py 2>&1 \
        | tee "$OUT/gpu-nixl-tests.txt" | tail -30 || rc=1
      PDFABRIC_GPU_RESULTS=$OUT PDFABRIC_TEST_NIXL_DEVICE_MEMORY=1 timeout 45 python3 -m pytest -q -p no:cacheprovider -rs \
        tests/gpu/test_nixl_gpu.py -k engine 2>&1 | tee -a "$OUT/gpu-nixl-tests.txt" | tail -30 || rc=1
      timeout ${NIXL_BENCH_TIMEOUT:-220} python3 benchmarks/gpu/nixl_gpu_bench.py ${NIXL_BENCH_ARGS:-} 2>&1 | tee "$OUT/nixl_gpu_bench.log" \
        | grep -v '^\[[0-9.]*\] \[\|INFO' | tail -60 || rc=1 ;;
    *) echo "unknown step $step"; rc=2 ;;
  esac
done
echo "== done $(date -u +%T) rc=$rc"
exit $rc
