"""The THOR-aware layers of keras_thor 0.1, kept for their users.

THOR now preconditions Keras's own layers (see
`keras_thor.curvature_coverage`), so these subclasses add nothing: they
compute, and THOR treats them, exactly as their Keras parents. They stay
so that code and `.keras` files written for keras_thor 0.1 keep working;
`keras_thor.to_keras_model` turns them into their parents.
"""

import keras

from keras_thor.src.api_export import keras_thor_export


@keras_thor_export
class ThorDense(keras.layers.Dense):
    """`keras.layers.Dense` (kept from keras_thor 0.1; use `Dense`)."""


@keras_thor_export
class ThorConv2D(keras.layers.Conv2D):
    """`keras.layers.Conv2D` (kept from keras_thor 0.1; use `Conv2D`)."""


@keras_thor_export
class ThorEmbedding(keras.layers.Embedding):
    """`keras.layers.Embedding` (kept from keras_thor 0.1; use
    `Embedding`)."""


@keras_thor_export
class ThorLayerNormalization(keras.layers.LayerNormalization):
    """`keras.layers.LayerNormalization` (kept from keras_thor 0.1; use
    `LayerNormalization`)."""
