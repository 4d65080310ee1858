# The two commands a new machine needs: `make demo` and `make test`.
# Both use one virtual environment, .venv, created with the machine's Python 3.11 when it is
# missing. `make demo` installs the project with what the demo needs (Ray); `make test` adds
# every other extra and the test tools. Installing builds the C interposer and the simulated
# CUDA driver with the system C compiler. Each install is remembered by a stamp file in .venv
# and redone only when pyproject.toml, setup.py or the C sources change; a venv made by
# `make demo` is upgraded in place by `make test`.

PYTHON_BOOT ?= $(shell command -v python3.11 || command -v python3)
VENV        ?= .venv
PY          := $(VENV)/bin/python
DEMO_STAMP  := $(VENV)/.qgpu-demo
TEST_STAMP  := $(VENV)/.qgpu-test
NATIVE_SRC  := $(wildcard setup.py enforcement/native/*/*.c enforcement/native/*/*.h)
SOURCES     := pyproject.toml $(NATIVE_SRC)
PYTEST_ARGS ?=
# The suite waits on simulated GPU timelines, Ray and Dask start-ups and watchdog windows for
# about half its wall time: two pytest-xdist workers (whole files each, so a file's module
# fixtures are made once) fill that. `make test PYTEST_JOBS=0` runs it in one process.
PYTEST_JOBS ?= 2

.PHONY: demo test lint bench install clean

$(PY):
	@echo "==> creating $(VENV) with $(PYTHON_BOOT)"
	$(PYTHON_BOOT) -m venv $(VENV)
	@echo "==> upgrading pip in $(VENV)"
	$(PY) -m pip install --quiet --upgrade pip

# The demo's install; a venv that already has the test extras keeps them (one venv).
$(DEMO_STAMP): $(SOURCES) | $(PY)
	@if [ -e $(TEST_STAMP) ]; then extras=all,dev; else extras=ray; fi; \
	echo "==> installing qgpu[$$extras] into $(VENV): Python packages (a first install downloads Ray, a few minutes), then the C interposer and simulated driver"; \
	$(PY) -m pip install --progress-bar on -e ".[$$extras]" || exit $$?; \
	if [ "$$extras" = all,dev ]; then touch $(TEST_STAMP); fi
	@touch $(DEMO_STAMP)
	@echo "==> $(VENV) is ready"

$(TEST_STAMP): $(SOURCES) | $(PY)
	@echo "==> installing qgpu[all,dev] into $(VENV): Ray, Dask, Kubernetes and the test tools (a first install takes a few minutes), then the C interposer and simulated driver"
	$(PY) -m pip install --progress-bar on -e '.[all,dev]'
	@touch $(TEST_STAMP) $(DEMO_STAMP)
	@echo "==> $(VENV) is ready"

install: $(TEST_STAMP)

demo: $(DEMO_STAMP)
	@echo "==> running examples/demo.py (about a minute)"
	$(PY) examples/demo.py

test: $(TEST_STAMP)
	@echo "==> ruff"
	$(PY) -m ruff check .
	@echo "==> pytest (the whole suite, $(PYTEST_JOBS) workers; about 9 minutes on 2 cores)"
	$(PY) -m pytest -n $(PYTEST_JOBS) --dist loadfile $(PYTEST_ARGS)

lint: $(TEST_STAMP)
	$(PY) -m ruff check .

bench: $(TEST_STAMP)
	$(PY) bench/placement_latency.py

clean:
	rm -rf $(VENV) build *.egg-info
	find . -name '*.so' -path './enforcement/*' -delete
