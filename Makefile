# `make run` and `make test` set everything up from a fresh clone: a virtual environment in
# .venv with dsgd installed in editable mode, then run the default spec or the test suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dsgd-installed
TEST_STAMP := $(VENV)/.dsgd-test-installed

# torch: pinned to 2.13.0 on machines without an NVIDIA GPU; with a GPU, pip picks a build within
# pyproject's range. Which build a pin gets depends on where pip looks: PyPI serves CUDA builds
# for Linux x86_64 (several GB), so on such a machine without a GPU name PyTorch's CPU index:
#   make setup TORCH_INDEX=<PyTorch's CPU wheel index URL>
# Empty (the default) uses pip's own configuration.
ifeq ($(shell command -v nvidia-smi >/dev/null 2>&1 && echo gpu),gpu)
TORCH := torch>=2.4,<2.15
EXTRAS := cuda
else
TORCH := torch==2.13.0
EXTRAS :=
endif
comma := ,
TORCH_INDEX ?=
TORCH_SOURCE := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)

.PHONY: setup setup-test run test test-all bench docs clean

setup: $(STAMP)

# `make run` needs dsgd alone; `make test` adds the test extras on top.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_SOURCE) "$(TORCH)"
	$(PY) -m pip install --quiet "$(TORCH)" -e ".$(if $(EXTRAS),[$(EXTRAS)])"
	touch $(STAMP)

setup-test: $(TEST_STAMP)

$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install --quiet "$(TORCH)" -e ".[test$(if $(EXTRAS),$(comma)$(EXTRAS))]"
	touch $(TEST_STAMP)

run: $(STAMP)
	$(VENV)/bin/dsgd run experiments.yaml
	$(VENV)/bin/dsgd plot --spec experiments.yaml --x seconds -o results.png

test: $(TEST_STAMP)
	$(PY) -m pytest -q

test-all: $(TEST_STAMP)
	$(PY) -m pip install --quiet "$(TORCH)" -e ".[test,ptx$(if $(EXTRAS),$(comma)$(EXTRAS))]"
	$(PY) -m pytest -q -m ""

bench: $(TEST_STAMP)
	$(PY) benchmarks/overhead.py

# docs/reference.md is generated from the plugins' option declarations (tests/test_docs.py
# fails when it is stale).
docs: $(STAMP)
	$(VENV)/bin/dsgd plugins --markdown > docs/reference.md.tmp && mv docs/reference.md.tmp docs/reference.md

clean:
	rm -rf $(VENV) build *.egg-info
