"""Test set-up: few threads, logical CPU devices, seeded randomness."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

LOGICAL_CPUS = 4


def _configure_tensorflow():
    import tensorflow as tf

    # Under pytest-xdist (`make test` runs 2 workers on CI's 2 cores) each
    # worker takes one thread; a plain `pytest` run keeps two.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    threads = 1 if workers > 1 else 2
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * LOGICAL_CPUS
    )


if keras.backend.backend() == "tensorflow":
    _configure_tensorflow()
elif keras.backend.backend() == "jax":
    import jax

    # The float64 golden runs need real float64 arrays.
    jax.config.update("jax_enable_x64", True)


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs the TensorFlow backend")
    no_thor = pytest.mark.skip(reason="THOR trains on TensorFlow and JAX")
    for item in items:
        if "tf_only" in item.keywords or "multi_device" in item.keywords:
            if keras.backend.backend() != "tensorflow":
                item.add_marker(skip)
        if "thor_training" in item.keywords:
            if keras.backend.backend() not in ("tensorflow", "jax"):
                item.add_marker(no_thor)


# Only TensorFlow compiles per-variable updates (keras_thor.src.backend).
FUSION_MODES = (
    ["compiled", "uncompiled"]
    if keras.backend.backend() == "tensorflow"
    else ["uncompiled"]
)


@pytest.fixture(params=FUSION_MODES)
def fusion_mode(request, monkeypatch):
    """Runs a test through both paths of `keras_thor.src.backend.fusion`.

    By default only variables of at least `MIN_FUSED_SIZE` elements take the
    compiled path; the golden tests use small ones, so force each path.
    """
    from keras_thor.src.backend import fusion

    size = 0 if request.param == "compiled" else 2**62
    monkeypatch.setattr(fusion, "MIN_FUSED_SIZE", size)
    return request.param


@pytest.fixture(autouse=True)
def _seeded():
    keras.utils.set_random_seed(0)
    np.random.seed(0)
    yield
    keras.backend.clear_session()
