"""keras_thor: THOR, ASGD/SAG and training accelerators for Keras 3."""

from keras_thor import boost
from keras_thor import callbacks
from keras_thor import layers
from keras_thor import models
from keras_thor import optimizers
from keras_thor import schedules
from keras_thor.src.loading import load_model
from keras_thor.src.thor.convert import convert_to_thor_model
from keras_thor.src.thor.convert import to_keras_model
from keras_thor.src.thor.coverage import curvature_coverage
from keras_thor.src.thor.optimizer import THOR as thor
from keras_thor.src.version import __version__

__all__ = [
    "boost",
    "callbacks",
    "convert_to_thor_model",
    "curvature_coverage",
    "layers",
    "load_model",
    "models",
    "optimizers",
    "schedules",
    "thor",
    "to_keras_model",
    "__version__",
]
