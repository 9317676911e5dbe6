"""Public optimizers of keras_thor."""

from keras_thor.src.optimizers.asgd import ASGD
from keras_thor.src.optimizers.sag import SAG
from keras_thor.src.thor.optimizer import THOR

__all__ = ["ASGD", "SAG", "THOR"]
