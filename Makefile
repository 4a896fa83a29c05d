# `make demo` and `make test` are all the set-up a fresh machine needs: each
# target creates .venv and installs the project into it when pyproject.toml or
# the version changed since the last install (the stamp file is keyed on their hash).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml ddpkit/_version.py | cksum | cut -d' ' -f1)
PYTEST_ARGS ?=
WORKERS ?= 3

.PHONY: demo test test-all check gpu-check lint bench docs venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml ddpkit/_version.py
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "Installing ddpkit and its dev tools into $(VENV) (the first time takes a few minutes) ..."
	@$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[dev]" 2>&1 \
		| grep -v "is ignored: it is neither a file nor a directory" || true
	@$(BIN)/python -c "import ddpkit, torch, torchvision, lmdb, pyarrow" \
		|| { echo "installation into $(VENV) failed; see the pip output above" >&2; exit 1; }
	@rm -f $(VENV)/.installed-*
	@touch $@

# The site: the docs' pages and the reference generated from the docstrings (mkdocs.yml), into
# site/. --strict: a broken link, anchor or reference is an error (tests/docs/test_site.py too).
docs: $(STAMP)
	$(BIN)/python docs/_build/reference.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Everything the demo writes stays under demo-out/ (its learning curves too): a checkout stays
# clean. docs/demo-curves.png, the picture docs/quickstart.md shows, is a copy of one run's.
demo: $(STAMP)
	$(BIN)/python examples/seresnext_lmdb.py --demo --out demo-out

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# One pytest run on three workers (pytest-xdist; WORKERS=N sets another count). On the
# 2-core machine most multi-process tests wait (processes starting, deadlines, signals),
# so a third worker keeps both cores busy: 2 workers took 580-700 s, 3 took 511 s, and 4
# took 578 s with a test of start-up time failing (docs/testing.md). The tests that start
# several processes (marker `serial`, see tests/conftest.py) go to a worker a file
# at a time (a markdown page's blocks a page at a time), so a module's shared job
# runs once; the longest groups start first and every other test fills in where
# a worker is free. It prints the 25 slowest tests; the total comes last. Status
# 5 (nothing selected, e.g. PYTEST_ARGS naming a marker no test has) is not a failure.
PYTEST := $(BIN)/python -m pytest --timeout=300 --durations=25

test: lint
	@start=$$(date +%s); \
	$(PYTEST) -n $(WORKERS) --dist loadgroup --no-loadscope-reorder $(PYTEST_ARGS); status=$$?; \
	echo "make test: $$(($$(date +%s) - start)) s of pytest (-n $(WORKERS), status $$status)"; \
	[ $$status -eq 0 ] || [ $$status -eq 5 ]

# The same, with the longer variants marked slow (tests/conftest.py; docs/testing.md lists them).
test-all:
	@$(MAKE) --no-print-directory test PYTEST_ARGS="--slow $(PYTEST_ARGS)"

# The inner loop while working: lint, then the single-process tests of the parts the working
# tree changes (tests/changed.py; all of them when it cannot tell), two at a time. The tests
# that start several processes (marker serial) and the docs' runs are make test's.
check: lint
	@start=$$(date +%s); \
	$(BIN)/python -m pytest -q -n 2 --timeout=120 -m "not serial and not gpu" \
		$$($(BIN)/python tests/changed.py) $(PYTEST_ARGS); status=$$?; \
	echo "make check: $$(($$(date +%s) - start)) s of pytest (single-process tests, status $$status)"; \
	[ $$status -eq 0 ] || [ $$status -eq 5 ]

# The GPU battery (tests/gpu) and benchmarks/gpu.py in one table, within 8 minutes; without
# CUDA it says so, lists its checks and exits 0.
gpu-check: $(STAMP)
	$(BIN)/python tests/gpu/gpu_check.py

# Every benchmarks/*.py except the _helpers; each prints ratios measured side by side.
bench: $(STAMP)
	@set -e; for f in benchmarks/[!_]*.py; do \
		echo "== $$f"; $(BIN)/python "$$f"; \
	done

clean:
	rm -rf $(VENV) build dist site *.egg-info .mypy_cache .ruff_cache .pytest_cache
