"""`OptimizerProcess`: MindSpore's optimizer rewriting, for Keras."""

from keras_thor.src.boost.boost_optimizer import BoostOptimizer
from keras_thor.src.boost.centralization import centralized_variable_paths


class OptimizerProcess:
    """Adds gradient centralization to an optimizer, as MindSpore's
    `mindspore.boost.OptimizerProcess`:

    ```python
    process = keras_thor.boost.OptimizerProcess(keras.optimizers.SGD(0.1))
    process.add_grad_centralization(model)
    optimizer = process.generate_new_optimizer()  # a BoostOptimizer
    ```

    The variables are chosen with MindSpore's rule: weights of rank ≥ 2
    whose fan-in is a multiple of 16, not named beta/gamma/bias, not in a
    grouped or depthwise convolution or a `FullNorm` head.

    Args:
        opt: A `keras.optimizers.Optimizer` (or a `BoostOptimizer`).
    """

    def __init__(self, opt):
        self.optimizer = opt
        self.centralized_variables = []

    def add_grad_centralization(self, network):
        """Selects `network`'s variables whose gradients are centralized."""
        self.centralized_variables = centralized_variable_paths(network)
        return self.centralized_variables

    def generate_new_optimizer(self):
        """A `BoostOptimizer` over the optimizer, centralizing the
        selected variables' gradients (other settings kept)."""
        if isinstance(self.optimizer, BoostOptimizer):
            return self.optimizer.replaced(
                centralized_variables=self.centralized_variables
            )
        return BoostOptimizer(
            self.optimizer, centralized_variables=self.centralized_variables
        )
