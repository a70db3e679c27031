# pdfabric: the README's two commands are `make demo` and `make test`; the rest are their parts.
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON = $(shell bash hack/venv.sh 2>/dev/null | tail -n1)
PYTEST_ARGS ?=
# make test's workers (pytest-xdist): a test module is one unit of work, handed out longest first
# (tests/parallel.py). On 2 cores most tests wait on processes, not the CPU (docs/testing.md).
PYTEST_WORKERS ?= 2
XDIST = -n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder

.PHONY: help
help: ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-18s %s\n", $$1, $$2}'

.PHONY: deps
deps: ## everything the demo needs, vLLM's environment too (cached outside the repo; built side by side)
	@$(MAKE) --no-print-directory -j4 venv binaries prometheus vllm-venv

.PHONY: test-deps
test-deps: ## everything the tests need: the demo's, and vLLM's environment, built side by side
	@$(MAKE) --no-print-directory -j4 venv binaries prometheus vllm-venv vllm-official

.PHONY: venv
venv: ## Python environment with torch, kopf, mooncake (reinstalled only when pins change)
	@bash hack/venv.sh >/dev/null

.PHONY: vllm-venv
vllm-venv: ## vLLM's CPU build, NIXL and vllm-router in an environment of their own, for the vLLM tests (hack/vllm/venv.sh)
	@bash hack/vllm/venv.sh >/dev/null

.PHONY: vllm-official
vllm-official: vllm-venv ## the official vLLM release's wheel over that environment, for its classes (hack/vllm/official.sh)
	@bash hack/vllm/official.sh >/dev/null

.PHONY: binaries
binaries: ## build etcd, kube-apiserver, controller-manager, scheduler, kubectl, kwok, helm from Go modules
	@bash hack/controlplane/build.sh >/dev/null

.PHONY: prometheus
prometheus: venv ## Debian's prometheus package, unpacked (after the venv: both may run apt-get)
	@bash hack/prometheus.sh >/dev/null

IMAGES ?= operator agent

.PHONY: images
images: images-deps ## build the container images with podman or docker (IMAGES="operator agent agent-cuda13"; docs/images.md)
	@bash hack/images.sh build $(IMAGES)

.PHONY: images-deps
images-deps: ## install podman (runc, cgroupfs; images/containers.conf) and mmdebstrap from Debian when missing
	@bash hack/images.sh deps

.PHONY: cluster-up
cluster-up: deps ## start the local control plane with fake GPU nodes (state in .artifacts/cluster)
	@cd hack && $(PYTHON) -m pdfabric_devcluster up

.PHONY: cluster-down
cluster-down: ## stop the local control plane
	@cd hack && $(PYTHON) -m pdfabric_devcluster down

.PHONY: demo
demo: deps ## run the demo on the embedded default configuration
	@PYTHON=$(PYTHON) bash hack/demo.sh

.PHONY: generate
generate: venv ## regenerate generated files: chart CRDs, docs/api.md, docs/metrics.md, dashboards
	@for f in crds/*.yaml; do [[ -s $$f ]] || { echo "$$f is empty" >&2; exit 1; }; done
	@cp crds/*.yaml charts/pdfabric/crds/
	@$(PYTHON) hack/gen_api_docs.py
	@$(PYTHON) hack/gen_metrics_docs.py
	@$(PYTHON) hack/gen_dashboards.py

.PHONY: lint
lint: venv ## ruff (lint + format check), the import layering contracts and mypy (strict: core, operator, agent, the SGLang plugin, the vLLM connector)
	@$(PYTHON) -m ruff check .
	@$(PYTHON) -m ruff format --check .
	@if [[ -f .importlinter ]]; then PYTHONPATH=core:operator:agent:integrations/sglang:integrations/vllm $(dir $(PYTHON))lint-imports --config .importlinter; fi
	@$(PYTHON) -m mypy core/pdfabric_core operator/pdfabric_operator agent/pdfabric_agent integrations/sglang/pdfabric_sglang integrations/vllm/pdfabric_vllm

.PHONY: test
test: test-deps ## everything CI runs: lint, unit, integration, e2e, images (docs/testing.md)
	@$(MAKE) --no-print-directory lint
	@$(PYTHON) -m pytest $(XDIST) $(PYTEST_ARGS)

.PHONY: test-upstream
test-upstream: deps ## SGLang's own backends where they are known wrong (the controls make test skips; tests/e2e/upstream.py)
	@PDFABRIC_UPSTREAM_CONTROLS=1 $(PYTHON) -m pytest -rxX $(PYTEST_ARGS) \
		"tests/e2e/test_sglang_shapes.py::test_shaped_pd_answers_equal_a_one_rank_server[mooncake-p-tp2-d-tp1-l2-kv1-float32]" \
		"tests/e2e/test_sglang_shapes.py::test_shaped_pd_answers_equal_a_one_rank_server[mooncake-p-tp1pp2-d-tp1-l3-kv2-bfloat16]" \
		"tests/e2e/test_sglang_servers.py::test_an_abort_in_flight_ends_the_request_and_the_servers_serve_on[mooncake-prefill]" \
		"tests/e2e/test_sglang_servers.py::test_an_abort_in_flight_ends_the_request_and_the_servers_serve_on[mooncake-decode]"

.PHONY: test-fast
test-fast: venv ## the inner loop: lint, unit and every test that needs no control plane (a few minutes warm)
	@$(MAKE) --no-print-directory lint
	@$(PYTHON) -m pytest $(XDIST) -m "not controlplane and not slow and not images" $(PYTEST_ARGS)

.PHONY: test-unit
test-unit: venv ## pure logic only (no cluster)
	@$(PYTHON) -m pytest tests/unit $(PYTEST_ARGS)

.PHONY: test-integration
test-integration: deps ## real control plane
	@$(PYTHON) -m pytest -m integration $(PYTEST_ARGS)

.PHONY: test-e2e
test-e2e: test-deps ## control plane + real agents + Prometheus, SGLang's and vLLM's real servers
	@$(PYTHON) -m pytest -m e2e $(PYTEST_ARGS)

.PHONY: bench
bench: deps ## benchmarks (print tables; ratios against a baseline measured in the same run)
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(PYTHON) $$b; done
