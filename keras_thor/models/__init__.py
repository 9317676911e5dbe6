"""Public models of keras_thor: Keras models that train with THOR."""

from keras_thor.src.boost.boost_model import BoostFunctional
from keras_thor.src.boost.boost_model import BoostSequential
from keras_thor.src.loading import load_model
from keras_thor.src.thor.convert import convert_to_thor_model
from keras_thor.src.thor.convert import to_keras_model
from keras_thor.src.thor.model import ThorFunctional
from keras_thor.src.thor.model import ThorModel
from keras_thor.src.thor.model import ThorSequential

__all__ = [
    "BoostFunctional",
    "BoostSequential",
    "ThorFunctional",
    "ThorModel",
    "ThorSequential",
    "convert_to_thor_model",
    "load_model",
    "to_keras_model",
]
