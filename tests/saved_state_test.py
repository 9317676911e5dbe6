"""Files saved by earlier code keep working (issue 23).

`tests/fixtures/saved_states/` holds, per case, a `.keras` file and a
`BackupAndRestore` directory written by commit df0f654 after 3 epochs,
and the trajectory that code took in 2 more epochs (per-step logs, final
weights and optimizer variables; see `generate_saved_states.py`). Each
loads under the code under test, without Keras's warnings about state it
could not load, with exactly the stored state, and then trains along the
stored trajectory.
"""

import logging
import os
import shutil
import warnings

import keras
import numpy as np
import pytest

import keras_thor
from tests.fixtures import generate_saved_states as saved

# ASGD and SAG run on every backend, THOR trains on TensorFlow and JAX: the
# files TensorFlow wrote resume on JAX along the same trajectory. Boost
# trains on TensorFlow only.
MARKS = {
    "asgd": (),
    "sag": (),
    "thor_default": pytest.mark.thor_training,
    "thor_all_options": pytest.mark.thor_training,
}
CASE_NAMES = [
    pytest.param(name, marks=MARKS.get(name, pytest.mark.tf_only))
    for name in sorted(saved.CASES)
]

FIXTURES = saved.DIRECTORY
RTOL, ATOL = 1e-5, 1e-6
# DimReduce's subspace BFGS state takes `s sᵀ / (yᵀs)` terms whose small
# denominators amplify float32 rounding: on an AMD EPYC its entries (up to
# about 90) end up to 3e-4 away from the Intel machine's that wrote the
# trajectory, while the weights and logs agree to 1e-5.
STATE_TOLERANCE = {"dim_reduce": (2e-3, 1e-3)}
# The sampled Fisher draws its targets with each backend's own generator
# (`keras_thor.src.backend.stateless_random`): on JAX the file's THOR with
# every option loads exactly, then trains on other draws than TensorFlow's,
# so there only its state is compared, and that it trains on.
OTHER_DRAWS = {"thor_all_options"}
# What Keras 3.15 only warns about when it loads part of a state, e.g.
# "Skipping variable loading for optimizer 'thor', because it has 40
# variables whereas the saved optimizer has 44 variables."
SUSPECT = ("variable", "could not be loaded", "skipping", "mismatch", "load")


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record)


class _NoLoadingWarnings:
    """Fails on any warning or logged warning that names loading or
    variables (Keras warns, not raises, when optimizer variables or
    objects do not match the file)."""

    def __enter__(self):
        self._catch = warnings.catch_warnings(record=True)
        self._warnings = self._catch.__enter__()
        warnings.simplefilter("always")
        self._handler = _Records()
        logging.getLogger().addHandler(self._handler)
        return self

    def __exit__(self, *exc_info):
        logging.getLogger().removeHandler(self._handler)
        self._catch.__exit__(*exc_info)
        if exc_info[0] is not None:
            return False
        messages = [str(w.message) for w in self._warnings] + [
            r.getMessage() for r in self._handler.records
        ]
        suspect = [
            m for m in messages if any(word in m.lower() for word in SUSPECT)
        ]
        assert not suspect, suspect
        return False


class _StateAtStart(keras.callbacks.Callback):
    """The weights and optimizer variables when training begins (after a
    `BackupAndRestore` listed before it has restored them)."""

    def on_train_begin(self, logs=None):
        self.weights = saved.weights_of(self.model)
        self.state = saved.optimizer_state(self.model)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A working folder holding DimReduce's relative `pca_mat_path`."""
    shutil.copy(os.path.join(FIXTURES, saved.PCA_FILE), tmp_path)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _stored(name):
    with np.load(os.path.join(FIXTURES, f"{name}.npz")) as stored:
        return {k: stored[k] for k in stored.files}


def _listed(stored, prefix):
    keys = sorted(k for k in stored if k.startswith(prefix + "__"))
    return [stored[k] for k in keys]


def _assert_equal_lists(actual, expected, what, rtol=0.0, atol=0.0):
    assert len(actual) == len(expected), (
        f"{what}: {len(actual)} values, the file's trajectory has "
        f"{len(expected)}"
    )
    for index, (a, e) in enumerate(zip(actual, expected)):
        assert np.shape(a) == np.shape(e), (what, index)
        np.testing.assert_allclose(
            a, e, rtol=rtol, atol=atol, err_msg=f"{what} [{index}]"
        )


def _file_state(optimizer, state):
    """`state` without the variables THOR creates after all those the files
    hold (`skipped_updates`, 0 here, and `trained_batch_size`, 0 until the
    first step or THOR's batch size), which they start at."""
    if not isinstance(optimizer, keras_thor.optimizers.THOR):
        return state
    skipped, batch = state[-2:]
    assert int(skipped) == 0
    assert int(batch) in (0, optimizer.batch_size)
    return state[:-2]


def _assert_loaded_state(weights, state, stored, optimizer):
    _assert_equal_lists(weights, _listed(stored, "saved_weight"), "weights")
    _assert_equal_lists(
        _file_state(optimizer, state),
        _listed(stored, "saved_optimizer"),
        "optimizer variables",
    )


def _assert_stored_trajectory(model, steps, stored, name):
    logs = steps.arrays()
    if keras.backend.backend() != "tensorflow" and name in OTHER_DRAWS:
        assert np.all(np.isfinite(logs["loss"])), logs["loss"]
        return
    tolerance = (RTOL, ATOL)
    expected = {k[len("log__") :]: v for k, v in stored.items() if "log__" in k}
    assert set(expected) <= set(logs), (sorted(expected), sorted(logs))
    for key, values in expected.items():
        np.testing.assert_allclose(
            logs[key], values, *tolerance, err_msg=f"log {key!r}"
        )
    _assert_equal_lists(
        saved.weights_of(model),
        _listed(stored, "final_weight"),
        "final weights",
        *tolerance,
    )
    _assert_equal_lists(
        _file_state(model.optimizer, saved.optimizer_state(model)),
        _listed(stored, "final_optimizer"),
        "final optimizer variables",
        *STATE_TOLERANCE.get(name, tolerance),
    )


@pytest.mark.parametrize("name", CASE_NAMES)
def test_keras_file_continues_the_stored_trajectory(name, workdir):
    case, stored = saved.CASES[name], _stored(name)
    with _NoLoadingWarnings():
        model = keras.models.load_model(os.path.join(FIXTURES, f"{name}.keras"))
    _assert_loaded_state(
        saved.weights_of(model),
        saved.optimizer_state(model),
        stored,
        model.optimizer,
    )
    steps = saved.StepLogs()
    data = (stored["x"], stored["y"])
    saved.fit(model, data, saved.AFTER, [*case.after_load(), steps])
    _assert_stored_trajectory(model, steps, stored, name)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_backup_and_restore_resumes_the_stored_trajectory(name, workdir):
    case, stored = saved.CASES[name], _stored(name)
    backup = str(workdir / "backup")  # a resumed fit that ends deletes it
    shutil.copytree(os.path.join(FIXTURES, f"{name}_backup"), backup)
    model, callbacks = case.make()
    start, steps = _StateAtStart(), saved.StepLogs()
    with _NoLoadingWarnings():
        saved.fit(
            model,
            (stored["x"], stored["y"]),
            saved.BEFORE + saved.AFTER,
            [
                *callbacks(),
                keras.callbacks.BackupAndRestore(backup),
                start,
                steps,
            ],
        )
    _assert_loaded_state(start.weights, start.state, stored, model.optimizer)
    _assert_stored_trajectory(model, steps, stored, name)
