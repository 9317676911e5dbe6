"""MindSpore's boost training accelerators for Keras models."""

from keras_thor.src.boost.adasum import AdaSum
from keras_thor.src.boost.auto_boost import AutoBoost
from keras_thor.src.boost.boost_model import to_boost_model
from keras_thor.src.boost.boost_optimizer import BoostOptimizer
from keras_thor.src.boost.boost_optimizer import GradientAccumulation
from keras_thor.src.boost.dim_reduce import DimReduce
from keras_thor.src.boost.gradient_freeze import GradientFreeze
from keras_thor.src.boost.group_loss_scale_manager import GroupLossScaleManager
from keras_thor.src.boost.less_bn import LessBN
from keras_thor.src.boost.optimizer_process import OptimizerProcess

__all__ = [
    "AdaSum",
    "AutoBoost",
    "BoostOptimizer",
    "DimReduce",
    "GradientAccumulation",
    "GradientFreeze",
    "GroupLossScaleManager",
    "LessBN",
    "OptimizerProcess",
    "to_boost_model",
]
