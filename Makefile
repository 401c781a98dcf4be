# The README's commands. Each target sets up .venv from scratch if it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# A CPU build of exactly this torch is on local disk; any other version downloads a CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,serve]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tformer train configs/gpt-builtin.toml --out runs/demo
	$(VENV)/bin/tformer generate runs/demo --prompt 'def ' --max-new-tokens 300 --num-samples 2

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

test: lint
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	$(PY) benchmarks/speed.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
