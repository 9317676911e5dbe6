"""Keras models built from the reference's layer specs, and their weights."""

import keras
import numpy as np

import keras_thor

_WEIGHT_NAMES = {
    "dense": ("kernel", "bias"),
    "conv2d": ("kernel", "bias"),
    "embedding": ("embeddings",),
    "layer_norm": ("gamma", "beta"),
}


def _layer(spec, index):
    kind, name = spec["type"], f"layer{index}"
    if kind == "dense":
        return keras.layers.Dense(
            spec["units"],
            activation=spec.get("activation", "linear"),
            use_bias=spec.get("use_bias", True),
            name=name,
        )
    if kind == "conv2d":
        return keras.layers.Conv2D(
            spec["filters"],
            spec["kernel_size"],
            strides=spec.get("strides", (1, 1)),
            padding=spec.get("padding", "valid"),
            dilation_rate=spec.get("dilation_rate", (1, 1)),
            activation=spec.get("activation", "linear"),
            use_bias=spec.get("use_bias", True),
            name=name,
        )
    if kind == "embedding":
        return keras.layers.Embedding(
            spec["input_dim"], spec["output_dim"], name=name
        )
    if kind == "layer_norm":
        return keras.layers.LayerNormalization(
            epsilon=spec.get("epsilon", 1e-3), name=name
        )
    return {
        "flatten": keras.layers.Flatten,
        "global_average_pooling1d": keras.layers.GlobalAveragePooling1D,
        "global_average_pooling2d": keras.layers.GlobalAveragePooling2D,
    }[kind](name=name)


def keras_model(specs, input_shape, input_dtype="float32"):
    """A `ThorSequential` with the layers of `specs`."""
    layers = [_layer(spec, i) for i, spec in enumerate(specs)]
    return keras_thor.models.ThorSequential(
        [keras.Input(input_shape, dtype=input_dtype), *layers]
    )


def _weight_names(spec):
    names = _WEIGHT_NAMES.get(spec["type"], ())
    if spec["type"] in ("dense", "conv2d") and not spec.get("use_bias", True):
        names = names[:1]
    return names


def reference_weights(model, specs):
    """The model's weights as the reference's list of per-layer dicts."""
    return [
        {
            name: keras.ops.convert_to_numpy(getattr(layer, name)).astype(
                "float64"
            )
            for name in _weight_names(spec)
        }
        for layer, spec in zip(model.layers, specs)
    ]


def flat(weights):
    """The reference's per-layer dicts as one list of arrays."""
    return [w for layer in weights for w in layer.values()]


def random_batches(x, y, batch_size):
    """Consecutive batches of `(x, y)`, as `fit(shuffle=False)` takes them."""
    return [
        (x[i : i + batch_size], y[i : i + batch_size])
        for i in range(0, len(x), batch_size)
    ]


def loss_object(name):
    if name == "mse":
        return keras.losses.MeanSquaredError()
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class WeightHistory(keras.callbacks.Callback):
    """Records the model's weights after every batch callback."""

    def __init__(self, specs):
        super().__init__()
        self.specs = specs
        self.history = []

    def on_train_batch_end(self, batch, logs=None):
        self.history.append(flat(reference_weights(self.model, self.specs)))


def relative_error(actual, expected):
    """max |a - e| / max |e| over a list of arrays."""
    scale = max(float(np.max(np.abs(e))) for e in expected)
    return max(
        float(np.max(np.abs(np.asarray(a) - e)))
        for a, e in zip(actual, expected)
    ) / max(scale, 1e-12)
