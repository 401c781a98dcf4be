# The README's commands. Each target sets up .venv from scratch if it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow test-gpu bench lint clean

$(STAMP): pyproject.toml
	@echo "setting up $(VENV) (PyTorch and this package; a few minutes the first time)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# A CPU build of exactly this torch is on local disk; any other version downloads a CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,interop,serve,structured,viz]'
	touch $(STAMP)

demo: $(STAMP)
	@echo "make demo: training a small GPT on this Python's standard library source, then sampling from it"
	@# A second `make demo` samples from the run the first one trained (rm -r runs/demo to retrain).
	test -d runs/demo/best || $(VENV)/bin/tformer train configs/gpt-builtin.toml --out runs/demo
	$(VENV)/bin/tformer generate runs/demo --prompt 'def ' --max-new-tokens 300 --num-samples 2

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

# Fast checks; the slow ones (torchrun, kill and resume, torch.compile) have their own target.
test: lint
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# Needs CUDA (the tests skip themselves without it); benchmarks/gpu.py prints the figures.
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,interop,bench]'
	$(PY) benchmarks/speed.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
