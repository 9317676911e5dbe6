"""Public callbacks of keras_thor."""

from keras_thor.src.callbacks.swap_averaged_weights import SwapAveragedWeights

__all__ = ["SwapAveragedWeights"]
