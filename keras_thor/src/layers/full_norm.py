"""`FullNorm`: MindSpore boost's normalized classifier head."""

import types

import keras
from keras import ops

from keras_thor.src import keras_internals
from keras_thor.src.api_export import keras_thor_export

# MindSpore's `L2Normalize` epsilon, a floor on the sum of squares.
EPSILON = 1e-4


def l2_normalize(x, axis):
    """`x / sqrt(max(Σ x², ε))` along `axis` (MindSpore's `L2Normalize`)."""
    squares = ops.sum(ops.square(x), axis=axis, keepdims=True)
    return x * ops.rsqrt(ops.maximum(squares, EPSILON))


def full_norm_outputs(inputs, kernel, multiplier, activation):
    """`activation(multiplier · x̂ @ Ŵ)` (see `FullNorm`)."""
    cosines = ops.matmul(
        l2_normalize(inputs, axis=-1), l2_normalize(kernel, axis=0)
    )
    outputs = ops.cast(multiplier, cosines.dtype) * cosines
    return outputs if activation is None else activation(outputs)


@keras_thor_export
class FullNorm(keras.layers.Layer):
    """A cosine classifier head: MindSpore's `CommonHeadLastFN`.

    ```
    outputs = activation(multiplier · x̂ @ Ŵ)
    x̂ = x / sqrt(max(Σ_features x², ε)),   Ŵ = W / sqrt(max(Σ_in W², ε))
    ```

    Notation:
        - `x`: the inputs, normalized per sample over the last axis.
        - `W`: the `(in, units)` kernel, each output column normalized.
        - `multiplier`: a trainable scalar (a learned temperature), 1.0 at
          first.
        - `ε`: 1e-4, MindSpore's floor on the sum of squares.

    There is no bias. `keras_thor.boost.LessBN(model, fn_flag=True)` puts
    one in place of a model's last `Dense`, with that layer's kernel.

    Args:
        units: Positive integer, the number of outputs.
        activation: Activation applied to the scaled cosines (default
            none: logits).
        kernel_initializer: Initializer of `W`.
    """

    def __init__(
        self,
        units,
        activation=None,
        kernel_initializer="glorot_uniform",
        **kwargs,
    ):
        super().__init__(**kwargs)
        if isinstance(units, bool) or not isinstance(units, int) or units < 1:
            raise ValueError(
                "Argument `units` must be a positive integer. "
                f"Received: units={units!r}"
            )
        self.units = units
        self.activation = keras.activations.get(activation)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.input_spec = keras.layers.InputSpec(min_ndim=2)

    def build(self, input_shape):
        features = input_shape[-1]
        self.kernel = self.add_weight(
            name="kernel",
            shape=(features, self.units),
            initializer=self.kernel_initializer,
        )
        self.multiplier = self.add_weight(
            name="multiplier", shape=(), initializer="ones"
        )
        self.input_spec = keras.layers.InputSpec(
            min_ndim=2, axes={-1: features}
        )

    def call(self, inputs):
        return full_norm_outputs(
            inputs, self.kernel, self.multiplier, self.activation
        )

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], self.units)

    def get_config(self):
        config = super().get_config()
        config.update(
            units=self.units,
            activation=keras.activations.serialize(self.activation),
            kernel_initializer=keras.initializers.serialize(
                self.kernel_initializer
            ),
        )
        return config


# The attribute of a `Dense` made a `FullNorm` head in place: the layer that
# holds the multiplier (saved with the `Dense`, under this name).
HEAD_MULTIPLIER = "full_norm_multiplier"


class _Multiplier(keras.layers.Layer):
    """The scalar multiplier of a `Dense` made a `FullNorm` head."""

    def build(self, input_shape=None):
        self.multiplier = self.add_weight(
            name="multiplier", shape=(), initializer="ones"
        )


def _head_call(layer, inputs, training=None):
    multiplier = getattr(layer, HEAD_MULTIPLIER).multiplier
    return full_norm_outputs(inputs, layer.kernel, multiplier, layer.activation)


def is_full_norm_head(layer):
    """Whether `layer` computes a `FullNorm`: one, or a `Dense` that
    `make_full_norm_head` made one."""
    return isinstance(layer, FullNorm) or isinstance(
        getattr(layer, HEAD_MULTIPLIER, None), _Multiplier
    )


def make_full_norm_head(dense):
    """Makes the built `keras.layers.Dense` `dense` compute a `FullNorm`
    in place, with its kernel: it gets a trainable multiplier (1.0, held by
    a sublayer saved with it), its bias is set to zero and frozen (the
    head has none), and its `call` becomes `FullNorm`'s. Its class,
    config and saved variables stay a `Dense`'s, so its model saves and
    loads as before. Making a head twice changes nothing."""
    if is_full_norm_head(dense):
        return
    multiplier = _Multiplier(name=f"{dense.name}_multiplier")
    multiplier.build()
    keras_internals.add_sublayer(dense, HEAD_MULTIPLIER, multiplier)
    if dense.bias is not None:
        dense.bias.assign(ops.zeros(dense.bias.shape, dense.bias.dtype))
        dense.bias.trainable = False
    object.__setattr__(dense, "call", types.MethodType(_head_call, dense))
