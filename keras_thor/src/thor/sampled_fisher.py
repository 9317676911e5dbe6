"""Sampled-label ("true") Fisher targets for THOR's `G` factors.

`THOR(fisher="sampled")` differentiates, on statistics steps, the compiled
loss at targets drawn from the model's own predictive distribution instead
of the data's labels (kfac-jax's `fisher_gradients`, one sample per
example). The samples are scaled so that the expected outer product of the
per-sample output gradients is the Gauss-Newton matrix of the compiled
loss:

```
sparse / categorical cross-entropy:  y ~ Categorical(softmax(z))
binary cross-entropy:                y ~ Bernoulli(σ(z)),   loss × √d
mean squared error:                  y ~ N(ŷ, d/2 · I)
```

Notation:
    - `z`: logits (or the logarithm of the predicted probabilities when the
      loss is not `from_logits`); `ŷ`: the prediction; `d`: the size of the
      last axis, over which Keras averages binary cross-entropy and mean
      squared error (hence the √d and the d/2).

The draws are stateless, from `(step, replica)`: a run repeats exactly and
a resumed run draws what the uninterrupted one would have.
"""

import keras
from keras import ops

from keras_thor.src.backend import stateless_random

_SPARSE = "sparse_categorical_crossentropy"
_CATEGORICAL = "categorical_crossentropy"
_BINARY = "binary_crossentropy"
_SQUARED = "mean_squared_error"
_NAMES = {
    _SPARSE: _SPARSE,
    _CATEGORICAL: _CATEGORICAL,
    _BINARY: _BINARY,
    _SQUARED: _SQUARED,
    "mse": _SQUARED,
}
_CLASSES = (
    (keras.losses.SparseCategoricalCrossentropy, _SPARSE),
    (keras.losses.CategoricalCrossentropy, _CATEGORICAL),
    (keras.losses.BinaryCrossentropy, _BINARY),
    (keras.losses.MeanSquaredError, _SQUARED),
)
_FUNCTIONS = {
    keras.losses.sparse_categorical_crossentropy: _SPARSE,
    keras.losses.categorical_crossentropy: _CATEGORICAL,
    keras.losses.binary_crossentropy: _BINARY,
    keras.losses.mean_squared_error: _SQUARED,
}


def fisher_loss_kind(loss):
    """`(kind, from_logits)` of a compiled loss the sampled Fisher supports.

    Raises a `ValueError` naming the loss otherwise.
    """
    if isinstance(loss, str) and loss in _NAMES:
        return _NAMES[loss], False
    given = loss
    if isinstance(loss, str):
        try:
            loss = keras.losses.get(loss)
        except ValueError:
            pass
    for cls, kind in _CLASSES:
        if isinstance(loss, cls):
            return kind, bool(getattr(loss, "from_logits", False))
    if callable(loss) and loss in _FUNCTIONS:
        return _FUNCTIONS[loss], False
    if isinstance(given, keras.losses.Loss):
        received = f"{type(given).__name__}(name={given.name!r})"
    else:
        received = repr(given)
    raise ValueError(
        '`THOR(fisher="sampled")` samples targets for one compiled loss: '
        "sparse or categorical cross-entropy, binary cross-entropy or mean "
        'squared error (or use `fisher="empirical"`). '
        f"Received: loss={received}"
    )


def sampled_targets(kind, from_logits, y_pred, seed):
    """Targets drawn from the predictive distribution of `y_pred`.

    `seed` is a stateless seed, an int tensor of shape `(2,)`. A row of
    `y_pred` with a NaN or an infinity still gets a class in `[0, classes)`
    (the categorical draw can return `classes` there); its gradients stay
    as non-finite as at the data's labels, so the statistics count a
    curvature trouble.
    """
    y_pred = ops.stop_gradient(ops.cast(y_pred, "float32"))
    if kind in (_SPARSE, _CATEGORICAL):
        classes = y_pred.shape[-1]
        logits = y_pred if from_logits else ops.log(ops.maximum(y_pred, 1e-12))
        drawn = stateless_random.categorical(
            ops.reshape(logits, (-1, classes)), seed
        )
        drawn = ops.clip(drawn, 0, classes - 1)
        labels = ops.reshape(drawn, ops.shape(y_pred)[:-1])
        if kind == _SPARSE:
            return labels
        return ops.one_hot(labels, classes)
    if kind == _BINARY:
        probabilities = ops.sigmoid(y_pred) if from_logits else y_pred
        uniform = stateless_random.uniform(ops.shape(y_pred), seed)
        return ops.cast(uniform < probabilities, "float32")
    width = float(y_pred.shape[-1] or 1)
    noise = stateless_random.normal(ops.shape(y_pred), seed)
    return y_pred + ops.sqrt(width / 2.0) * noise


def sampled_loss(kind, from_logits, targets, y_pred):
    """The mean over examples of the loss at sampled `targets`, scaled so
    that its per-sample gradients have the Gauss-Newton matrix as their
    expected outer product."""
    y_pred = ops.cast(y_pred, "float32")
    if kind == _SPARSE:
        losses = keras.losses.sparse_categorical_crossentropy(
            targets, y_pred, from_logits=from_logits
        )
    elif kind == _CATEGORICAL:
        losses = keras.losses.categorical_crossentropy(
            targets, y_pred, from_logits=from_logits
        )
    elif kind == _BINARY:
        losses = keras.losses.binary_crossentropy(
            targets, y_pred, from_logits=from_logits
        ) * ops.sqrt(float(y_pred.shape[-1] or 1))
    else:
        losses = keras.losses.mean_squared_error(targets, y_pred)
    return ops.mean(losses)
