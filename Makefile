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

.PHONY: install up test clean

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
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .afd-cache
