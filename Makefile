# The two commands a new machine needs: `make demo` and `make test`.
# Each creates .venv and installs the project (building the native interposer) when missing.

PYTHON_BOOT ?= $(shell command -v python3.11 || command -v python3)
VENV        ?= .venv
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.qgpu-installed
NATIVE_SRC  := $(wildcard setup.py enforcement/native/*/*.c enforcement/native/*/*.h)
PYTEST_ARGS ?=

.PHONY: demo test lint bench install clean

$(STAMP): pyproject.toml $(wildcard setup.py) $(NATIVE_SRC)
	@test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[all,dev]'
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .

bench: $(STAMP)
	$(PY) bench/placement_latency.py

clean:
	rm -rf $(VENV) build *.egg-info
	find . -name '*.so' -path './enforcement/*' -delete
