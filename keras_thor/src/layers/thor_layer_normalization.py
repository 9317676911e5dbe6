"""`LayerNormalization` whose scale and offset get THOR's diagonal rule."""

import keras

from keras_thor.src.api_export import keras_thor_export
from keras_thor.src.layers import capture


@keras_thor_export
class ThorLayerNormalization(keras.layers.LayerNormalization):
    """A `keras.layers.LayerNormalization` marked for THOR's diagonal rule.

    It computes exactly what `LayerNormalization` computes and records
    nothing: THOR preconditions its `gamma` and `beta` gradients on every
    step with MindSpore's diagonal rule

    ```
    g ← g / (g² / N + √λ)
    ```

    Notation:
        - `g`: the gradient of `gamma` or `beta`; `λ`: the damping of the
          step; `N`: THOR's `batch_size` argument.

    Arguments are those of `keras.layers.LayerNormalization`.
    """

    def build(self, input_shape):
        super().build(input_shape)
        for variable in (self.gamma, self.beta):
            if variable is not None:
                capture.mark_layer_norm(variable)
