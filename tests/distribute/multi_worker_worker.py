"""One worker of the MultiWorkerMirroredStrategy test (a separate process).

`python -m tests.distribute.multi_worker_worker INDEX PORTS OUT` joins the
loopback cluster `127.0.0.1:PORT` for each of the comma-separated `PORTS`
as worker `INDEX`, trains every model of `OPTIMIZERS` through `model.fit`
and writes its weights and logs to the `.npz` file `OUT`. The test imports
`train` to make the single-process reference.
"""

import json
import os
import sys

OPTIMIZERS = ("sgd", "asgd", "thor")
EPOCHS = 2


def _optimizer(name):
    import keras

    import keras_thor

    if name == "sgd":
        return keras.optimizers.SGD(0.05, momentum=0.9)
    if name == "asgd":
        return keras_thor.optimizers.ASGD(0.05, t0=3.0, weight_decay=0.01)
    return keras_thor.optimizers.THOR(
        0.05, damping=0.1, momentum=0.9, frequency=3, split_dim=4
    )


def train(name, strategy=None):
    """`{name: array}`: weights and logs after `fit` with optimizer `name`."""
    import contextlib

    import keras
    import numpy as np

    import keras_thor
    from tests import helpers

    x, y = helpers.regression_data()
    scope = strategy.scope() if strategy else contextlib.nullcontext()
    with scope:
        keras.utils.set_random_seed(0)
        model = keras_thor.convert_to_thor_model(helpers.mlp())
        model.compile(optimizer=_optimizer(name), loss="mse", metrics=["mae"])
    history = model.fit(
        x,
        y,
        batch_size=16,
        epochs=EPOCHS,
        shuffle=False,
        validation_data=(x[:32], y[:32]),
        verbose=0,
    )
    results = {
        f"weight_{i}": np.asarray(w) for i, w in enumerate(model.weights)
    }
    for key, values in history.history.items():
        results[f"log_{key}"] = np.asarray(values)
    results["evaluate"] = np.asarray(model.evaluate(x, y, verbose=0))
    return results


def main(index, ports, out):
    os.environ["TF_CONFIG"] = json.dumps(
        {
            "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
            "task": {"type": "worker", "index": index},
        }
    )
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    assert strategy.num_replicas_in_sync == len(ports)
    results = {}
    for name in OPTIMIZERS:
        for key, value in train(name, strategy).items():
            results[f"{name}/{key}"] = value
    np.savez(out, **results)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3])
