"""Run by `data_parallel_test.py` in a fresh process with two host devices:
THOR for 50 steps on one device, then under `keras.distribution.
DataParallel` over two, from the same weights at the same global batch.
Prints one JSON line: the largest differences of weights, THOR's state and
the logged losses. Its argument is a JSON object of THOR's arguments (and
`hidden_units`, the hidden layer's width; or `"model": "gpt2"`, a tiny
keras-hub `GPT2CausalLM` under `THOR.recommended`); with `model_parallel`,
it prints the error `compile` raises under `ModelParallel` instead."""

import json
import os
import sys

os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_thor  # noqa: E402

STEPS, BATCH = int(os.environ.get("DP_STEPS", 50)), 32


def _model(hidden_units=10, model=None, **thor_args):
    if model == "gpt2":
        from tests.thor.users_models_test import causal_lm

        return causal_lm(**thor_args)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((12,))
    x = keras.layers.Dense(hidden_units, activation="tanh")(inputs)
    x = keras.layers.LayerNormalization()(x)
    outputs = keras.layers.Dense(4)(x)
    model = keras_thor.convert_to_thor_model(keras.Model(inputs, outputs))
    model.compile(
        optimizer=keras_thor.optimizers.THOR(
            learning_rate=0.05,
            damping=0.05,
            momentum=0.9,
            weight_decay=1e-3,
            frequency=3,
            **thor_args,
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _train(distribution, x, y, thor_args):
    if distribution is not None:
        keras.distribution.set_distribution(distribution)
    model = _model(**thor_args)
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=STEPS * BATCH // len(y),
        verbose=0,
        shuffle=False,
    )
    weights = [keras.ops.convert_to_numpy(w) for w in model.weights]
    state = [keras.ops.convert_to_numpy(v) for v in model.optimizer.variables]
    keras.distribution.set_distribution(None)
    return weights, state, history.history["loss"], model.optimizer.batch_size


def _model_parallel_refusal():
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["dense.*kernel"] = (None, "model")
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    )
    try:
        _model()
    except ValueError as error:
        return str(error)
    return None


def main():
    if sys.argv[1] == "model_parallel":
        print(json.dumps({"error": _model_parallel_refusal()}))
        return
    thor_args = json.loads(sys.argv[1])
    if thor_args.get("model") == "gpt2":
        from tests.thor.users_models_test import token_data

        x, y = token_data(rows=BATCH * 5)
    else:
        rng = np.random.default_rng(0)
        x = 3 * rng.normal(size=(BATCH * 5, 12)).astype("float32")
        y = x[:, :4].argmax(axis=1)
    devices = keras.distribution.list_devices()
    one = _train(None, x, y, thor_args)
    two = _train(
        keras.distribution.DataParallel(devices=devices), x, y, thor_args
    )

    def gap(a, b):
        return max(
            float(np.max(np.abs(p - q))) if p.size else 0.0
            for p, q in zip(a, b)
        )

    print(
        json.dumps(
            {
                "devices": len(devices),
                "weights": gap(one[0], two[0]),
                "state": gap(one[1], two[1]),
                "loss": gap([np.array(one[2])], [np.array(two[2])]),
                "batch_size": [one[3], two[3]],
            }
        )
    )


if __name__ == "__main__":
    main()
