# The two commands a new user runs: `make demo` (the main job) and `make test` (the suite).
# Each creates .venv and installs what it needs on first use (torch==2.13.0 first, so that
# nothing else pulls a different torch), then reuses it.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.chunkmeta-installed

.PHONY: demo test test-gpu bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m chunkmeta

test: $(STAMP)
	$(PY) -m pytest

test-gpu: $(STAMP)
	$(PY) -m pytest -m gpu

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .benchmarks *.egg-info
