"""keras_thor: THOR, ASGD/SAG and training accelerators for Keras 3."""

from keras_thor import callbacks
from keras_thor import optimizers
from keras_thor import schedules
from keras_thor.src.version import __version__

__all__ = ["callbacks", "optimizers", "schedules", "__version__"]
