"""THOR under `keras.distribution.DataParallel` on JAX: two host devices
(a fresh process, `XLA_FLAGS` set before JAX starts) train as one device
does at the same global batch."""

import json
import os
import subprocess
import sys

import keras
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax",
    reason="keras.distribution is real on JAX only (Keras 3.15)",
)

SCRIPT = os.path.join(os.path.dirname(__file__), "data_parallel_script.py")


def _run(argument):
    root = os.path.dirname(os.path.dirname(os.path.dirname(SCRIPT)))
    environment = {**os.environ, "PYTHONPATH": root}
    environment.pop("XLA_FLAGS", None)
    result = subprocess.run(
        [sys.executable, SCRIPT, argument],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "thor_args",
    [
        {},
        # A 300-wide factor is cut into 3 blocks of 128: each device
        # inverts a stack of blocks at once, which deadlocked jaxlib 0.10.2's
        # batched LAPACK kernels on 2 cores (docs/thor.md, "Convolution
        # patches and LAPACK on JAX").
        {
            "factor_decay": 0.9,
            "kl_clip": 0.01,
            "fisher": "sampled",
            "hidden_units": 300,
        },
        # A keras-hub Task converted in place (dropout 0).
        {"model": "gpt2"},
    ],
    ids=["mindspore_rule", "options", "keras_hub_gpt2"],
)
def test_two_devices_train_as_one(thor_args):
    if "model" in thor_args:
        pytest.importorskip("keras_hub")
    gaps = _run(json.dumps(thor_args))
    assert gaps["devices"] == 2
    # THOR's batch size is the global batch: the step sees the whole of it.
    assert gaps["batch_size"] == [32, 32]
    assert gaps["weights"] < 1e-4, gaps
    assert gaps["loss"] < 1e-4, gaps
    if "model" not in thor_args:
        # The preset's damping (1e-3) on the GPT's nearly singular `G`
        # factors gives inverses with entries near 4e11, which the order of
        # a sum across devices moves by 2.5%: the weights they lead to
        # agree within 1e-4 all the same.
        assert gaps["state"] < 1e-4, gaps


def test_model_parallel_is_refused_at_compile():
    error = _run("model_parallel")["error"]
    assert error is not None
    assert "DataParallel" in error and "ModelParallel" in error
