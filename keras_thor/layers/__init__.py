"""Public THOR-aware layers of keras_thor."""

from keras_thor.src.layers.full_norm import FullNorm
from keras_thor.src.layers.thor_conv2d import ThorConv2D
from keras_thor.src.layers.thor_dense import ThorDense
from keras_thor.src.layers.thor_embedding import ThorEmbedding
from keras_thor.src.layers.thor_layer_normalization import (
    ThorLayerNormalization,
)

__all__ = [
    "FullNorm",
    "ThorConv2D",
    "ThorDense",
    "ThorEmbedding",
    "ThorLayerNormalization",
]
