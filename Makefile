# The two commands of the README:
#   make demo   - set up a virtual environment and run the workflow on a small generated volume
#   make test   - set up a virtual environment and run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-lowest lint faults test-hosts bench bench-runtimes clean

setup: $(VENV)/.installed

# what znni runs with: the demo needs nothing more (the test tools and PyTorch come on top)
$(VENV)/.runtime: pyproject.toml requirements-lock.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q uv
	# the exact versions the tests pass with (users get pyproject.toml's ranges)
	$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) -c requirements-lock.txt -e .
	touch $@

$(VENV)/.installed: $(VENV)/.runtime
	$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) -c requirements-lock.txt -e ".[dev]"
	# PyTorch is a test-only reference; pip (not uv) finds the local CPU wheel.
	$(VENV)/bin/pip install -q torch==2.13.0
	touch $@

demo: $(VENV)/.runtime
	PATH="$(abspath $(VENV))/bin:$$PATH" bash scripts/demo.sh

# Subprocess-heavy tests (Snakemake jobs) need bytecode caching; some machines disable it.
# First the linter and the formatter's check (ruff, configured in pyproject.toml), then the tests
# and the docstrings' examples.
test: setup lint
	env -u PYTHONDONTWRITEBYTECODE PATH="$(abspath $(VENV))/bin:$$PATH" NUMBA_THREADING_LAYER=threadsafe \
		$(PY) -m pytest -q -m "not slow and not gpu" -p no:cacheprovider -n 2 --dist loadfile \
		tests --doctest-modules znni_core

# The lowest versions pyproject.toml allows (uv's lowest-direct: each runtime dependency at its lower
# bound, transitive ones at their newest) in .venv-lowest, the test tools at their locked versions
# and PyTorch as in setup, then a fast subset of the tests that uses every runtime dependency (~2-3
# min; tests/test_install.py checks that each dependency did install at its bound). No bytecode is
# compiled ahead: the tests write what they import.
LOWEST := .venv-lowest
LOWEST_TESTS := tests/test_install.py tests/test_settings.py tests/test_net.py tests/test_cli.py tests/test_serve.py \
	tests/test_io.py tests/test_layers_conv.py::test_all_paths_equal_torch_conv3d \
	tests/test_layers_conv.py::test_fftconv_reuses_kernel_spectra_across_calls_and_batches \
	tests/test_layers_conv.py::test_thread_limits_scan_the_libraries_again_only_after_an_import \
	tests/test_pipeline.py::test_tasks_equal_whole_volume_inference \
	tests/test_pipeline.py::test_job_overlaps_read_compute_and_store_with_bounded_memory \
	tests/test_zarr_output.py::test_corrupt_shard_is_named_and_a_rerun_rewrites_only_its_shard \
	tests/test_workflow.py::test_lint_and_dry_run

$(LOWEST)/.installed: pyproject.toml requirements-lock.txt $(VENV)/.installed
	rm -rf $(LOWEST)
	$(VENV)/bin/uv venv -q --seed --python $(PYTHON) $(LOWEST)
	$(VENV)/bin/uv pip install -q --python $(LOWEST)/bin/python --resolution lowest-direct -e .
	$(VENV)/bin/uv pip install -q --python $(LOWEST)/bin/python \
		$$(grep -E '^(pytest|pytest-timeout|hypothesis)==' requirements-lock.txt)
	$(LOWEST)/bin/pip install -q --no-compile torch==2.13.0
	touch $@

# moto, tensorstore and the user-install test (newest versions) are not in that environment
test-lowest: $(LOWEST)/.installed
	env -u PYTHONDONTWRITEBYTECODE PATH="$(abspath $(LOWEST))/bin:$$PATH" NUMBA_THREADING_LAYER=threadsafe ZNNI_LOWEST=1 \
		$(LOWEST)/bin/python -m pytest -q -p no:cacheprovider -k "not s3 and not tensorstore and not user_install" \
		$(LOWEST_TESTS)

lint: setup
	$(VENV)/bin/ruff check znni_core tests benchmarks
	$(VENV)/bin/ruff format --check znni_core tests benchmarks

# The fault catalogue at full strength (docs/reliability.md): every slow case, T4's chained kills
# 20 times locally and 20 times on SLURM (needs scripts/slurm/up.sh first for the SLURM half).
# CI runs a prefix of the same seeded chains; run this before a release.
faults: setup
	env -u PYTHONDONTWRITEBYTECODE PATH="$(abspath $(VENV))/bin:$$PATH" NUMBA_THREADING_LAYER=threadsafe \
		ZNNI_FAULT_KILLS=20 ZNNI_SLURM_KILLS=20 ZNNI_NODE_FAIL=1 $(PY) -m pytest -q -m slow -p no:cacheprovider -rA

# The planning and pipeline tests under two other hosts' rates (tests/other_host.py): what a plan
# test asserts must not depend on the machine that runs it.
test-hosts: setup
	for host in gemm-fast winograd-fast; do \
		env -u PYTHONDONTWRITEBYTECODE PATH="$(abspath $(VENV))/bin:$$PATH" NUMBA_THREADING_LAYER=threadsafe \
			ZNNI_TEST_HOST=$$host $(PY) -m pytest -q -m "not slow and not gpu" -p no:cacheprovider -n 2 \
			tests/test_plan.py tests/test_pipeline.py tests/test_graph.py tests/test_engine.py \
			tests/test_device.py tests/test_tuning.py tests/test_sharding.py || exit 1; \
	done

bench: setup
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m benchmarks

# znni vs PyTorch, ONNX Runtime and OpenVINO (f32) as users call them: benchmarks/RUNTIMES.md
bench-runtimes: setup
	$(VENV)/bin/uv pip install -q --python $(PY) -c requirements-lock.txt -e ".[dev,bench]"
	PATH="$(abspath $(VENV))/bin:$$PATH" NUMBA_THREADING_LAYER=threadsafe $(PY) -m benchmarks.runtimes

clean:
	rm -rf $(VENV) $(LOWEST) demo_out .pytest_cache .snakemake
