"""Gradient freezing's part of a `BoostOptimizer` step."""

from keras_thor.src.boost.algorithm import BoostAlgorithm
from keras_thor.src.boost.algorithm import checked_setting
from keras_thor.src.boost.algorithm import has_method


class Freezing(BoostAlgorithm):
    """Trains one group of variables per step, from the schedule of a
    `keras_thor.boost.GradientFreeze` (`setting`):

    ```
    k = setting.group_at(t);  step t trains the variables of group k only
    ```

    Notation:
        - `t`: the micro-step; `k`: a suffix group of `groups`
          (`setting.split_parameters_groups(model)`).
    """

    argument = "grad_freeze"
    refuses = ("grad_accumulation_step",)
    refusal = (
        "Gradient freezing and gradient accumulation do not combine "
        "(MindSpore's combination is broken; keras_thor refuses it)."
    )
    needs_boost_model = True

    @classmethod
    def validated(cls, setting):
        # Checked by what is used: the freezing builds boost optimizers
        # itself (`freeze_generate`), so this module does not import it.
        return checked_setting(
            "grad_freeze",
            setting,
            "keras_thor.boost.GradientFreeze",
            has_method("group_at"),
        )

    def bind(self, model):
        self.groups = self.setting.split_parameters_groups(model)

    def trained_variables(self, group, variables):
        return self.groups[group]

    def trained_group(self, step):
        return self.setting.group_at(step)
