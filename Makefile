# Two commands do all the set-up: `make demo` and `make test`.
# Each creates .venv and installs the project when it is absent or stale.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-unit test-campaign bench cluster-up cluster-down clean-venv

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch==2.13.0 is the CPU build on this machine's disk; a bare `torch` pulls a multi-GB CUDA build.
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)  ## train the tiny GPT on the embedded corpus with 2 workers on a local Ray
	$(VENV)/bin/etrain train --config tiny

test: $(STAMP)  ## lint and format check (ruff), then the whole test suite on one shared local Ray instance
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest

test-unit: $(STAMP)  ## the tests that start no Ray and no process group (about two minutes): the loop while editing
	$(PY) -m pytest -m unit -q

test-campaign: $(STAMP)  ## the scenarios of minutes `make test` leaves out (an autoscaler's cluster: the README recipe, preemption, the health drill); run before changing scaling, draining or health
	$(PY) -m pytest --campaign -m campaign

bench: $(STAMP)  ## throughput vs plain torch and Ray Train, written to bench/results/
	$(PY) bench/throughput.py

cluster-up: $(STAMP)  ## a local Ray head: token auth, the fake multi-node autoscaler; prints the exports its clients need
	$(VENV)/bin/etrain cluster up

cluster-down: $(STAMP)  ## stop it: its processes only, never `ray stop`
	$(VENV)/bin/etrain cluster down

clean-venv:
	rm -rf $(VENV)
