# pdunit: every entry point a developer or CI uses. `make run` and `make test` work on
# a fresh machine: both depend on `install`, which creates .venv and installs pinned.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Cache folders outside the repo, reused by CI's fresh clone on the same machine.
PDUNIT_CACHE ?= $(HOME)/.cache/pdunit
export PDUNIT_CACHE

# The folders that make up the pdunit package (pyproject's package-dir), and the ones linted.
PKG_DIRS := pkg engine kernels sidecars operator bench
LINT_DIRS := $(PKG_DIRS) tests
# The package's files as the install links them (modules, stubs, package data).
PKG_FILES := $(VENV)/.package-files

.PHONY: install lock run test test-flaky test-gpu test-slow test-images images bench fmt lint proto crds chart-files envtest helm clean

install: $(STAMP)

# Strict editable mode: build/__editable__.*/pdunit/ links each file of the package, a
# plain folder that mypy and other tools read (the default mode's import hook is invisible
# to them). A module added, removed or renamed is linked only by a reinstall, so the stamp
# depends on the list of package files, rewritten only when a file comes or goes.
# The .pth imports the stdlib's operator at interpreter start, before `python -m` puts the
# repo root (and its operator/ folder) first on sys.path.
$(STAMP): pyproject.toml constraints.txt $(PKG_FILES)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[engine,operator,bench,dev]' --config-settings editable_mode=strict
	echo 'import operator  # pdunit: stdlib operator first (make install)' \
	  > "$$($(BIN)/python -P -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/pdunit_stdlib_first.pth"
	touch $(STAMP)

$(PKG_FILES): FORCE
	@mkdir -p $(VENV)
	@find $(PKG_DIRS) -name __pycache__ -prune -o -type f \( -name '*.py' -o -name '*.pyi' \
	  -o -name '*.proto' -o -name py.typed \) -print | LC_ALL=C sort > $@.new
	@if cmp -s $@.new $@; then rm $@.new; else mv $@.new $@; fi

FORCE:

# Regenerate the transitive pins from what is installed now.
lock:
	$(BIN)/pip freeze --exclude-editable | grep -v '^-e' > constraints.txt

# The main job: a whole unit as local processes on CPU with the tiny random CSM and Mimi,
# a short load, the stream table and the KV check counters, then one POST
# /v1/audio/speech into .out/out.wav (noise: the weights are random).
run: install
	$(BIN)/pdunit local --model random:csm-tiny:0 --codec random:mimi-tiny:0 --lb-port 0 \
	  --load-streams 6 --load-frames 105 --load-api speech --speak "Hello from pdunit." --speak-out .out/out.wav

# Every test CI runs (not gpu-only, slow or e2e; those skip or are deselected), after lint,
# on TEST_WORKERS pytest-xdist workers (a file's tests stay on one worker, and so do the
# envtest control plane's: tests/conftest.py), the slowest 20 listed at the end. A crashed
# worker ends the run as a failure naming the test (--max-worker-restart 0): xdist 3.8's
# loadgroup scheduler can hang forever after replacing one (the flake hunt of 88296ea).
TEST_WORKERS ?= 2
test: install lint envtest helm
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --max-worker-restart 0 --durations=20; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: that is a failure" >&2; exit 1; fi; \
	exit $$rc

# The flake hunt (tools/flaky/run.sh): `make test`'s CI command on fresh clones of HEAD,
# twice plain, once in random order, twice with every core busy. FLAKY_RUNS=2 or
# FLAKY_RUNS=random,busy runs fewer; FLAKY_ARGS='tests/engine -x' a subset.
test-flaky:
	bash tools/flaky/run.sh

test-gpu: install
	$(BIN)/python -m pytest -q -m gpu

test-slow: install
	$(BIN)/python -m pytest -q -m slow

# The operator and unit images built from images/ and run (tests/images/test_images.py:
# `pdunit --help` in each, no torch in the operator image), with buildah on a local Debian
# base; installs buildah and debootstrap with apt when missing. Not in `make test`: the unit
# image is torch + CUDA wheels, minutes and ~10 GB. Timings: $(PDUNIT_CACHE)/images/last-run.json.
test-images: install
	command -v buildah >/dev/null && command -v debootstrap >/dev/null || \
	  { apt-get update -q && apt-get install -y -q buildah debootstrap; }
	PDUNIT_IMAGES_REQUIRED=1 $(BIN)/python -m pytest -q -n 0 -s -m images tests/images

# Release images for IMAGE_PLATFORMS (default linux/amd64,linux/arm64) as manifest lists
# pdunit/{unit,operator}:IMAGE_TAG, from the real bases (tools/images/build.sh; PUSH=1 and
# IMAGE_REGISTRY push them). Another arch than the host's needs qemu-user-static + binfmt.
images:
	bash tools/images/build.sh

bench: install
	$(BIN)/pdunit bench edges

fmt: install
	$(BIN)/ruff format $(LINT_DIRS)
	$(BIN)/ruff check --fix $(LINT_DIRS)

# mypy checks the installed package (every pdunit import resolved); its cache lives outside
# the clone (entries are checked by content hash, so a fresh clone reuses them). mypy names
# files by their link under build/__editable__.*: the filter prints the repo's path instead.
lint: install
	$(BIN)/ruff check $(LINT_DIRS)
	set -o pipefail; $(BIN)/mypy --cache-dir "$(PDUNIT_CACHE)/mypy" -p pdunit | $(BIN)/python -P -c \
	  'import os, re, sys; [print(re.sub(r"^build/__editable__[^:]*", lambda m: os.path.relpath(os.path.realpath(m[0])), line), end="") for line in sys.stdin]'

proto: install
	$(BIN)/python -m pdunit.engine.proto.build engine/proto
	$(BIN)/python -m pdunit.operator.proto.build

# The chart's generated dashboard and alert rules (operator/chart_files.py).
chart-files: install
	$(BIN)/python -m pdunit.operator.chart_files

crds: install
	$(BIN)/python -m pdunit.operator.crdgen crds
	bash tools/helm/sync-crds.sh

# kube-apiserver + etcd for the operator's integration tests (envtest), from
# KUBEBUILDER_ASSETS when set, else built once from pinned Go modules into the cache.
envtest:
	bash tools/envtest/ensure.sh

# A pinned real helm: the one on PATH if its version matches, else `go install`.
helm:
	bash tools/helm/ensure.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .mypy_cache
