"""`Dense` whose kernel THOR preconditions."""

import keras
from keras import ops

from keras_thor.src.api_export import keras_thor_export
from keras_thor.src.curvature.preconditioning import factored_is_cheaper
from keras_thor.src.curvature.preconditioning import factored_precondition
from keras_thor.src.curvature.statistics import dense_statistics
from keras_thor.src.layers import capture


@keras_thor_export
class ThorDense(keras.layers.Dense):
    """A `keras.layers.Dense` that exposes THOR's curvature statistics.

    It computes exactly what `Dense` computes. On THOR's curvature-refresh
    steps (inside `keras_thor.models.ThorModel`'s training step) it also
    records its inputs and pre-activation outputs, from which THOR builds

    ```
    A = XᵀX / rows,   G = DᵀD / rows
    ```

    Notation:
        - `X`: the inputs, all leading axes flattened into rows.
        - `D`: the per-sample gradient of the loss with respect to the
          pre-activation `X @ kernel + bias`, in the same rows.

    THOR then preconditions the kernel gradient as `A⁻¹ · g · G⁻¹`; the bias
    gets the plain gradient. Where the rows are fewer than about the layer's
    width, THOR forms the same product as `(A⁻¹Xᵀ)(D·G⁻¹)` from the
    layer's inputs and output gradients (fewer flops, and the backward
    pass's `XᵀD` is skipped). Arguments are those of `keras.layers.Dense`.
    """

    def build(self, input_shape):
        super().build(input_shape)
        capture.mark_kernel(self._kernel, self)

    def call(self, inputs, training=None):
        if not capture.capturing():
            return super().call(inputs, training=training)
        outputs = ops.matmul(inputs, self.kernel)
        if self.bias is not None:
            outputs = ops.add(outputs, self.bias)
        capture.record(self, inputs, outputs)
        if self.activation is not None:
            outputs = self.activation(outputs)
        return outputs

    @property
    def thor_kernel(self):
        """The variable THOR preconditions with the Kronecker factors."""
        return self._kernel

    def thor_factor_dims(self):
        """`(d_in, d_out, a_is_diagonal)`: the sizes of A and G."""
        return self._kernel.shape[0], self._kernel.shape[1], False

    def thor_statistics(self, inputs, sample_output_grads):
        """`(XᵀX, DᵀD, rows, factor_scale)` of one call."""
        return (*dense_statistics(inputs, sample_output_grads), 1.0)

    def thor_prefers_factored(self, inputs, batch_size):
        """Whether the factored order is cheaper for a call on `inputs`.

        The rows are the static size of `inputs`' leading axes, with
        `batch_size` standing in for an unknown batch size.
        """
        leading = [batch_size if d is None else d for d in inputs.shape[:-1]]
        if any(d is None for d in leading):
            return False
        rows = 1
        for dimension in leading:
            rows *= dimension
        d_in, d_out, _ = self.thor_factor_dims()
        return factored_is_cheaper(d_in, d_out, rows)

    def thor_factored_gradient(
        self, inputs, output_grads, a_inverse, g_inverse
    ):
        """`A⁻¹ · g · G⁻¹` of one call, from its inputs and output gradients."""
        d_in, d_out, _ = self.thor_factor_dims()
        rows = ops.reshape(ops.cast(inputs, "float32"), (-1, d_in))
        grads = ops.reshape(ops.cast(output_grads, "float32"), (-1, d_out))
        return factored_precondition(rows, grads, a_inverse, g_inverse)
