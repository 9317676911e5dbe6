"""Public callbacks of keras_thor."""

from keras_thor.src.boost.dim_reduce import DimReduce
from keras_thor.src.boost.gradient_freeze import GradientFreeze
from keras_thor.src.boost.group_loss_scale import GroupLossScale
from keras_thor.src.callbacks.swap_averaged_weights import SwapAveragedWeights

__all__ = [
    "DimReduce",
    "GradientFreeze",
    "GroupLossScale",
    "SwapAveragedWeights",
]
