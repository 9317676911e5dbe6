"""keras_thor: THOR, ASGD/SAG and training accelerators for Keras 3."""

from keras_thor import boost
from keras_thor import callbacks
from keras_thor import layers
from keras_thor import models
from keras_thor import optimizers
from keras_thor import schedules
from keras_thor.src.models.convert import convert_to_thor_model
from keras_thor.src.optimizers.thor import THOR as thor
from keras_thor.src.version import __version__

__all__ = [
    "boost",
    "callbacks",
    "convert_to_thor_model",
    "layers",
    "models",
    "optimizers",
    "schedules",
    "thor",
    "__version__",
]
