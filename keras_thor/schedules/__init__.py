"""Public schedules of keras_thor (MindSpore's THOR recipes)."""

from keras_thor.src.schedules.bert import bert_thor_damping
from keras_thor.src.schedules.bert import bert_thor_learning_rate
from keras_thor.src.schedules.per_step import PerStepSchedule
from keras_thor.src.schedules.thor_resnet_damping import ThorResNetDamping
from keras_thor.src.schedules.thor_resnet_learning_rate import (
    ThorResNetLearningRate,
)

__all__ = [
    "PerStepSchedule",
    "ThorResNetDamping",
    "ThorResNetLearningRate",
    "bert_thor_damping",
    "bert_thor_learning_rate",
]
