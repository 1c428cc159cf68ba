# Set-up and entry points. `make demo` and `make test` each create .venv if it is missing, install the project
# into it (editable), then run. Nothing is downloaded at run time: the demo and the tests make their own data.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test test-fast lint lint-imports bench gpu-check clean-venv

# constraints.txt pins the exact torch make and CI test (pyproject.toml declares the supported range).
# pip runs with -qq: its errors still show, its warnings and the build backend's notes do not (setuptools says of
# every editable install of a package-dir mapping like ours: "Please be careful with folders in your working
# directory with the same name as your package"; pyproject.toml lists every package, so it warns of nothing else).
$(STAMP): pyproject.toml constraints.txt
	@echo "squad set-up: installing squad and its dependencies into $(VENV) (minutes the first time)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -qq --upgrade pip
	@$(PY) -m pip install -qq -e '.[test]' -c constraints.txt
	@$(PY) tools/prepare_deepspeed.py
	@touch $(STAMP)
	@echo "squad set-up: done"

demo: $(STAMP)
	@$(PY) tools/demo.py

# The suite runs in TEST_JOBS pytest-xdist workers (a file's tests stay in one worker: its module fixtures run once),
# its files in the order tests/conftest.py collects them (the longest first);
# TEST_JOBS=0 runs it in this process. Three workers on a 2-core machine: many tests wait on processes they launch
# (DeepSpeed ranks, signals, timeouts), and a third worker fills that time (a clean clone here: 20:57 of tests with 3
# workers, 21:37 with 2).
TEST_JOBS ?= 3
test: $(STAMP)
	$(MAKE) --no-print-directory lint-imports
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder tests

# The quick subset (no end-to-end runs: tests marked `slow` are left out), a few minutes.
test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder -m "not slow" tests

# The import floors declared in pyproject.toml ([tool.importlinter]). import-linter finds modules on disk, so it reads
# a copy of the package with tasks/ and kernels/ where they are installed (squad/tasks, squad/kernels).
lint-imports: $(STAMP)
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && cp -r squad "$$tmp/squad" && cp -r tasks "$$tmp/squad/tasks" \
		&& cp -r kernels "$$tmp/squad/kernels" && cd "$$tmp" \
		&& PYTHONPATH="$$tmp" "$(CURDIR)/$(VENV)/bin/lint-imports" --no-cache "$(CURDIR)/pyproject.toml"

lint: $(STAMP)
	$(PY) -m ruff check squad tasks kernels tools tests

bench: $(STAMP)
	$(PY) tools/bench.py

# One GPU's check (GPU tests, GPU bench rows beside the H100 cost model, train steps, a 60-step DeepSpeed run; at most
# 9 minutes on an H100): gpu_check.json and gpu_check.md in GPU_CHECK_OUT (default $$OUT/gpu-check, else
# reports/gpu_check). No .venv is built: a lent GPU machine has its own python3 (docs/gpu.md, "make gpu-check").
GPU_PY = $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	$(GPU_PY) tools/gpu_check.py $(if $(GPU_CHECK_OUT),--out $(GPU_CHECK_OUT))

clean-venv:
	rm -rf $(VENV)
