"""`FullNorm`: MindSpore boost's normalized classifier head."""

import keras
from keras import ops

from keras_thor.src.api_export import keras_thor_export

# MindSpore's `L2Normalize` epsilon, a floor on the sum of squares.
EPSILON = 1e-4


def l2_normalize(x, axis):
    """`x / sqrt(max(Σ x², ε))` along `axis` (MindSpore's `L2Normalize`)."""
    squares = ops.sum(ops.square(x), axis=axis, keepdims=True)
    return x * ops.rsqrt(ops.maximum(squares, EPSILON))


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
        cosines = ops.matmul(
            l2_normalize(inputs, axis=-1), l2_normalize(self.kernel, axis=0)
        )
        outputs = ops.cast(self.multiplier, cosines.dtype) * cosines
        if self.activation is not None:
            outputs = self.activation(outputs)
        return outputs

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
