"""Gradient centralization's part of a `BoostOptimizer` step."""

from keras_thor.src.boost.algorithm import BoostAlgorithm
from keras_thor.src.boost.centralization import centralize_gradient


class Centralization(BoostAlgorithm):
    """Centralizes the gradients of the variables at `setting` (paths):

    ```
    g_p ← g_p − mean(g_p)     (over every axis but the last), p ∈ setting
    ```

    Notation:
        - `g_p`: the gradient of the variable whose path is `p`.
    """

    argument = "centralized_variables"

    @classmethod
    def validated(cls, setting):
        if isinstance(setting, str) or not all(
            isinstance(path, str) for path in setting
        ):
            raise TypeError(
                "Argument `centralized_variables` must be a list of "
                "variable paths (strings). "
                f"Received: centralized_variables={setting!r}"
            )
        return list(setting)

    @classmethod
    def enabled(cls, setting):
        return bool(setting)

    @classmethod
    def serialized(cls, setting):
        return list(setting)

    @classmethod
    def deserialized(cls, config, custom_objects=None):
        return config

    def transform(self, grads, variables):
        paths = set(self.setting)
        return [
            centralize_gradient(g) if g is not None and v.path in paths else g
            for g, v in zip(grads, variables)
        ]
