"""Public optimizers of keras_thor."""

from keras_thor.src.optimizers.asgd import ASGD
from keras_thor.src.optimizers.sag import SAG

__all__ = ["ASGD", "SAG"]
