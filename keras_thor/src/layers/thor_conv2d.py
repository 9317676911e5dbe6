"""`Conv2D` whose kernel THOR preconditions."""

import keras
from keras import ops

from keras_thor.src.api_export import keras_thor_export
from keras_thor.src.curvature.statistics import conv2d_factor_scale
from keras_thor.src.curvature.statistics import conv2d_statistics
from keras_thor.src.layers import capture


def _channels_last(tensor, data_format):
    if data_format == "channels_first":
        return ops.transpose(tensor, (0, 2, 3, 1))
    return tensor


@keras_thor_export
class ThorConv2D(keras.layers.Conv2D):
    """A `keras.layers.Conv2D` that exposes THOR's curvature statistics.

    It computes exactly what `Conv2D` computes. On THOR's curvature-refresh
    steps it records its inputs and pre-activation outputs; THOR builds the
    factors through im2col, with the layer's own padding, strides and
    dilation, one row per (example, output position):

    ```
    A = MᵀM / (N·T),   G = DᵀD / (N·T)
    g ← (√T·A + √λ·I)⁻¹ · g · (√T·G + √λ·I)⁻¹
    ```

    Notation:
        - `M`: the input patches, each flattened in `(kh, kw, C_in)` order,
          the kernel's own order; `D`: the per-sample output gradients.
        - `N`: examples; `T`: output positions `H_out · W_out`.
        - `λ`: THOR's damping; `√T` splits the spatial sum of K-FAC's
          convolution factor between A and G, as MindSpore does.

    Grouped convolutions (`groups > 1`) are not THOR-aware:
    `convert_to_thor_model` leaves them as `Conv2D`. Arguments are those of
    `keras.layers.Conv2D`.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.groups != 1:
            raise ValueError(
                "`ThorConv2D` needs `groups=1`: THOR has no factorization "
                f"for grouped convolutions. Received: groups={self.groups}"
            )

    def build(self, input_shape):
        super().build(input_shape)
        capture.mark_kernel(self._kernel, self)

    def call(self, inputs):
        if not capture.capturing():
            return super().call(inputs)
        outputs = self.convolution_op(inputs, self.kernel)
        if self.use_bias:
            if self.data_format == "channels_last":
                bias_shape = (1, 1, 1, self.filters)
            else:
                bias_shape = (1, self.filters, 1, 1)
            outputs = ops.add(outputs, ops.reshape(self.bias, bias_shape))
        capture.record(self, inputs, outputs)
        if self.activation is not None:
            outputs = self.activation(outputs)
        return outputs

    @property
    def thor_kernel(self):
        """The variable THOR preconditions with the Kronecker factors."""
        return self._kernel

    def thor_factor_dims(self):
        """`(kh·kw·C_in, C_out, a_is_diagonal)`: the sizes of A and G."""
        kh, kw, channels, filters = self._kernel.shape
        return kh * kw * channels, filters, False

    def thor_statistics(self, inputs, sample_output_grads):
        """`(MᵀM, DᵀD, rows, √T)` of one call."""
        inputs = _channels_last(inputs, self.data_format)
        grads = _channels_last(sample_output_grads, self.data_format)
        statistics = conv2d_statistics(
            inputs,
            grads,
            self.kernel_size,
            self.strides,
            self.dilation_rate,
            self.padding,
        )
        return (*statistics, conv2d_factor_scale(grads))
