# `make run` and `make test` set everything up from a fresh clone: a virtual environment in
# .venv with dsgd installed in editable mode, then run the default spec or the test suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dsgd-installed

# torch: the CPU build on machines without an NVIDIA GPU (pip would otherwise pull a
# multi-GB CUDA build); with a GPU, pip picks a CUDA build within pyproject's range.
ifeq ($(shell command -v nvidia-smi >/dev/null 2>&1 && echo gpu),gpu)
TORCH := torch>=2.4,<2.15
else
TORCH := torch==2.13.0
endif

.PHONY: setup run test test-all bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet "$(TORCH)" -e ".[test]"
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/dsgd run experiments.yaml
	$(VENV)/bin/dsgd plot --spec experiments.yaml --x seconds -o results.png

test: $(STAMP)
	$(PY) -m pytest -q

test-all: $(STAMP)
	$(PY) -m pytest -q -m ""

bench: $(STAMP)
	$(PY) benchmarks/overhead.py

clean:
	rm -rf $(VENV) build *.egg-info
