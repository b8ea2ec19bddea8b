# Every target creates .venv and installs the project into it when missing or stale.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast soak bench up lint format clean real-servers docs

BASE_STAMP := $(VENV)/.installed-base

# the package with its stack extra runs the demo and `claw up` (no test tools, browsers or torch)
$(BASE_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[stack]'
	touch $(BASE_STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP) $(BASE_STAMP)

demo: $(BASE_STAMP)
	$(BIN)/claw demo

up: $(BASE_STAMP)
	$(BIN)/claw up

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

test: lint
	$(BIN)/python -m pytest -m "not soak" -q -n 2

soak: $(STAMP)
	$(BIN)/python -m pytest -m soak -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	for script in benchmarks/[a-z]*.py; do \
	  case $$script in */harness.py|*/loadgen.py|*/baseline_app.py|*/relay_floor.py) continue;; esac; \
	  CLAW_BENCH_RECORD=benchmarks/results $(BIN)/python $$script || exit 1; \
	done

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) lake .claw .pytest_cache .site

# Real third-party parts the conformance and adapter tests check against, installed beside the
# test extra without their GPU stacks (vLLM's protocol modules, verl's DataProto), then those
# tests with a missing import a failure instead of a skip.
REAL_SERVER_PACKAGES := vllm==0.33.0 cbor2 psutil pyzmq aiohttp aiohappyeyeballs aiosignal \
	frozenlist openai-harmony pybase64 cachetools msgspec cloudpickle py-cpuinfo \
	verl==0.9.1 ray msgpack tensordict pyvers omegaconf codetiming orjson
real-servers: $(STAMP)
	$(BIN)/python -m pip install --quiet --no-deps $(REAL_SERVER_PACKAGES)
	CLAW_REAL_SERVERS=required $(BIN)/python -m pytest -q -m "not soak" \
	  tests/gateway/proxy/test_vllm_conformance.py tests/train/test_adapters.py
