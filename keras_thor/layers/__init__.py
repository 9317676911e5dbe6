"""Public layers of keras_thor."""

from keras_thor.src.layers.full_norm import FullNorm
from keras_thor.src.layers.loss_scale_group import LossScaleGroup
from keras_thor.src.layers.thor_layers import ThorConv2D
from keras_thor.src.layers.thor_layers import ThorDense
from keras_thor.src.layers.thor_layers import ThorEmbedding
from keras_thor.src.layers.thor_layers import ThorLayerNormalization

__all__ = [
    "FullNorm",
    "LossScaleGroup",
    "ThorConv2D",
    "ThorDense",
    "ThorEmbedding",
    "ThorLayerNormalization",
]
