"""`Embedding` whose table THOR preconditions."""

import keras

from keras_thor.src.api_export import keras_thor_export
from keras_thor.src.curvature.statistics import embedding_statistics
from keras_thor.src.layers import capture


@keras_thor_export
class ThorEmbedding(keras.layers.Embedding):
    """A `keras.layers.Embedding` that exposes THOR's curvature statistics.

    It computes exactly what `Embedding` computes. An embedding is a
    bias-free Dense layer on one-hot ids, so THOR applies the Dense rule
    with the diagonal input factor that one-hot rows give:

    ```
    a = counts / rows,   G = DᵀD / rows
    g ← diag(1 / (a + √λ)) · g · (G + √λ·I)⁻¹
    ```

    Notation:
        - `counts`: how often each id occurs in the batch; `rows`: the
          number of ids looked up.
        - `D`: the per-sample gradients of the looked-up vectors.
        - `λ`: THOR's damping.

    Arguments are those of `keras.layers.Embedding`.
    """

    def build(self, input_shape=None):
        super().build(input_shape)
        capture.mark_kernel(self._embeddings, self)

    def call(self, inputs):
        outputs = super().call(inputs)
        if capture.capturing():
            capture.record(self, inputs, outputs)
        return outputs

    @property
    def thor_kernel(self):
        """The variable THOR preconditions with the Kronecker factors."""
        return self._embeddings

    def thor_factor_dims(self):
        """`(input_dim, output_dim, a_is_diagonal)`: the sizes of a and G."""
        return self.input_dim, self.output_dim, True

    def thor_statistics(self, inputs, sample_output_grads):
        """`(counts, DᵀD, rows, 1.0)` of one call."""
        statistics = embedding_statistics(
            inputs, sample_output_grads, self.input_dim
        )
        return (*statistics, 1.0)
