# Two commands work on a fresh machine with Python 3.11 and make: `make run`, `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=

# Install steps write their output (venv, pip) to $(INSTALL_LOG) and print only the
# failing step's part of it, then fail. The first run says so in one line (it takes about
# two minutes, and a silent terminal looks hung); after that `make run` says nothing
# before the gateway does.
INSTALL_LOG := $(VENV)/install.log
LOGGED = sh -c 'touch "$$0"; size=$$(wc -c < "$$0"); echo "+ $$*" >> "$$0"; "$$@" >> "$$0" 2>&1 && exit 0; \
	status=$$?; tail -c +$$((size + 1)) "$$0" >&2; \
	echo "make: the step above failed (exit $$status); the whole log is $$0" >&2; exit $$status' \
	$(INSTALL_LOG)

.PHONY: run test test-fast lint simulate check-config bench bench-trace bench-prefill-heavy bench-two-speed bench-real bench-overhead bench-loop-lag bench-shadow clean

# Decided when make starts, before any rule runs: is there a venv yet?
FRESH_VENV := $(if $(wildcard $(PY)),,yes)

$(PY):
	@echo "make: first run: installing into $(VENV) (about two minutes, once; log: $(INSTALL_LOG))"
	@mkdir -p $(VENV)
	@$(LOGGED) $(PYTHON) -m venv $(VENV)
	@$(LOGGED) $(PY) -m pip install --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(if $(FRESH_VENV),,@echo "make: reinstalling the project into $(VENV) (pyproject.toml is newer; log: $(INSTALL_LOG))")
	@$(LOGGED) $(PY) -m pip install -e '.[test,dev]'
	@touch $(STAMP)

## run: the gateway on 127.0.0.1:8080 (in front of the built-in simulator unless a backend is configured)
run: $(STAMP)
	@$(PY) -m gateway serve $(ARGS)

## test: the whole suite (what CI runs). Most of its time is spent waiting on the servers
## it starts, so it runs in TEST_WORKERS processes (a file's tests stay in one: 842 s
## alone, 320 s in three on 2 cores); then the tests marked `serial` (they load both
## cores themselves, or time what the machine does) run one at a time, on a quiet machine.
TEST_WORKERS ?= 3
# pytest exits 5 when it collected no test: ARGS naming only one part's tests.
PYTEST_PART = sh -c '"$$@"; status=$$?; [ $$status = 5 ] && exit 0; exit $$status' pytest-part
test: $(STAMP)
	@echo "make: the suite in $(TEST_WORKERS) processes, then the tests marked serial"
	@$(PYTEST_PART) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not serial" $(ARGS)
	@$(PYTEST_PART) $(PY) -m pytest -q -m serial $(ARGS)

## test-fast: the inner loop, about a minute: the suite without the tests marked `slow`, in
## two parts as `test` runs it: in TEST_WORKERS processes, then its tests marked `serial`
## one at a time (beside the other tests, their timings fail).
test-fast: $(STAMP)
	@echo "make: the suite without slow tests in $(TEST_WORKERS) processes, then its tests marked serial"
	@$(PYTEST_PART) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow and not serial" $(ARGS)
	@$(PYTEST_PART) $(PY) -m pytest -q -m "serial and not slow" $(ARGS)

## install-report, install-tracing: an optional extra into .venv (`analyze --html`'s
## matplotlib; `[tracing] enabled`'s OpenTelemetry SDK). The package is on no index, so
## `pip install 'llm-tail-gateway[report]'` cannot work; this installs the clone's own.
.PHONY: install-report install-tracing
install-report install-tracing: $(PY)
	$(PY) -m pip install -e '.[$(@:install-%=%)]'

## docs: the docs site from docs/ into build/docs (warnings, such as a broken link, fail it)
## docs-serve: that site on http://127.0.0.1:8001
.PHONY: docs docs-serve
DOCS_OUT := build/docs
docs: $(STAMP)
	$(PY) -m sphinx -W --keep-going -n -q -b html docs $(DOCS_OUT)

docs-serve: docs
	$(PY) -m http.server --bind 127.0.0.1 --directory $(DOCS_OUT) 8001

## image: the OCI image localhost/llm-tail-gateway:latest (podman or buildah); with no
## reachable registry: `make image IMAGE_ARGS=--local` (a debootstrap base, wheels from here)
IMAGE_ARGS ?=
.PHONY: image test-image
image: $(STAMP)
	PYTHON=$(PY) deploy/image/build.sh $(IMAGE_ARGS)

## test-image: builds the image on the local base, runs it, streams from it (~1-2 min, root)
test-image: $(STAMP)
	$(PY) -m pytest -q -m image tests/deploy/test_image.py $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check gateway tests scripts
	$(PY) -m mypy gateway

simulate: $(STAMP)
	$(PY) -m gateway simulate $(ARGS)

check-config: $(STAMP)
	$(PY) -m gateway check-config $(ARGS)

## bench: the tail benchmark (direct vs FIFO vs lanes, 80% and 120% load), ~15 min
bench: $(STAMP)
	$(PY) scripts/bench_tail.py $(ARGS)

bench-trace: $(STAMP)
	$(PY) scripts/bench_tail.py --scenario trace $(ARGS)

## bench-prefill-heavy: the tail benchmark with code-completion-like traffic (long prompts, short outputs)
bench-prefill-heavy: $(STAMP)
	$(PY) scripts/bench_tail.py --mix prefill-heavy $(ARGS)

## bench-two-speed: a fast and a 4x slower backend: does the gateway learn which is which?
bench-two-speed: $(STAMP)
	$(PY) scripts/bench_two_speed.py $(ARGS)

## bench-real: the tail benchmark against llama.cpp's server + Gemma 3 270M (builds once, ~10 min)
bench-real: $(STAMP)
	mkdir -p results
	scripts/bench_real.sh $(ARGS)

## bench-overhead: what the gateway adds over the backend, a bare aiohttp proxy and nginx
bench-overhead: $(STAMP)
	$(PY) scripts/bench_overhead.py $(ARGS)

bench-loop-lag: $(STAMP)
	$(PY) scripts/bench_loop_lag.py $(ARGS)

## bench-shadow: the primary's short-lane P99 TTFT with shadow traffic off vs at 100%, ~4 min
bench-shadow: $(STAMP)
	$(PY) scripts/bench_shadow.py $(ARGS)

.PHONY: bench-fairness
## bench-fairness: three API keys on a simulator, first come vs fair share: a flood, weights 2:1, a tenant back from idle, ~12 min (ARGS=--quick ~6)
bench-fairness: $(STAMP)
	$(PY) scripts/bench_fairness.py $(ARGS)

.PHONY: bench-cache
## bench-cache: multi-turn chat and agents on 4 simulators, least-load vs cache-aware routing, ~10 min (--quick ~5)
bench-cache: $(STAMP)
	$(PY) scripts/bench_cache.py $(ARGS)

.PHONY: bench-adapters
## bench-adapters: 4 LoRA adapters on 2 simulators (max_lora 2), model-blind vs adapter-aware routing, ~2 min (--seconds 10 --reps 1: ~1)
bench-adapters: $(STAMP)
	$(PY) scripts/bench_adapters.py $(ARGS)

.PHONY: bench-replay
## bench-replay: `gateway replay` in virtual time vs the real gateway in real time (per-class P99 TTFT), hour wall time, ~35 min (ARGS=--quick ~4; ARGS='--loads "" --target-p99 0.6': the sweep checked in real time, ~15 min)
bench-replay: $(STAMP)
	$(PY) scripts/bench_replay.py $(ARGS)

.PHONY: bench-replicas
## bench-replicas: 3 gateway replicas sharing Redis: slots, quota, SIGKILL, Redis outage, lease cost, ~6 min (ARGS=--quick ~3)
bench-replicas: $(STAMP)
	$(PY) scripts/bench_replicas.py $(ARGS)

.PHONY: bench-retry-storm
## bench-retry-storm: 30% of clients retry refusals at once at 120% load, retry damping off vs on, side by side, ~2.5 min
bench-retry-storm: $(STAMP)
	$(PY) scripts/bench_retry_storm.py $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache

.PHONY: bench-models
## bench-models: two models on two simulators: B's short P99 alone vs with A's pool at 150%, misrouted requests, an alias moving 10% → 50% → 100%, ~3 min
bench-models: $(STAMP)
	$(PY) scripts/bench_models.py $(ARGS)

.PHONY: bench-pool-leases
## bench-pool-leases: 2 replicas, 1 Redis, 2 models: each engine's own peak vs its slots, this tree vs 51c7045 (before per-pool leases), ~1.5 min (ARGS='--seconds 5 --reps 1' ~40 s)
bench-pool-leases: $(STAMP)
	$(PY) scripts/bench_pool_leases.py $(ARGS)
