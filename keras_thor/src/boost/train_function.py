"""The `model.train_function` of keras_thor's boost models: one traced
variant per (trained group, update) pair, chosen in Python per step."""

from keras_thor.src import keras_internals
from keras_thor.src.backend.values import numpy_value
from keras_thor.src.boost.training import dim_reduce_train_step
from keras_thor.src.boost.training import train_step
from keras_thor.src.distribute.train_step import reduce_logs


class BoostTrainFunction:
    """`model.train_function` of a boost model with a `BoostOptimizer`.

    Each call runs up to `model.steps_per_execution` steps (fewer at the
    end of the data), each step one traced call of the variant its step
    number selects: the group to train (gradient freezing) and whether to
    update (gradient accumulation). The step number is read from the
    optimizer's `micro_steps` at the start of each `fit` and then counted
    in Python (every step counts, so it never drifts).
    """

    def __init__(self, model):
        self.model = model
        optimizer = model.optimizer
        variables = list(model.trainable_variables)
        if not optimizer.built:
            # Its variables are the strategy's (a boost callback may have
            # made the optimizer outside its scope).
            with model.distribute_strategy.scope():
                optimizer.build(variables)
        self._components = (
            None
            if optimizer.dim_reduce is None
            else optimizer.dim_reduce.components_variable(model)
        )
        if optimizer.group_loss_scale is not None:
            optimizer.group_loss_scale.bind(model)
        freeze = optimizer.grad_freeze
        self._groups = (
            [variables]
            if freeze is None
            else freeze.split_parameters_groups(model)
        )
        self._variants = {}
        self._step = None

    def resync(self):
        """Reads the step number from the optimizer before the next step."""
        self._step = None

    def _variant(self, group, update):
        key = (group, update)
        if key not in self._variants:
            self._variants[key] = self._compile(self._groups[group], update)
        return self._variants[key]

    def _compile(self, variables, update):
        import tensorflow as tf

        model = self.model
        components = self._components

        def step(batch):
            if components is not None:
                return dim_reduce_train_step(
                    model, batch, variables, components
                )
            return train_step(model, batch, variables, update)

        def one_step(data):
            strategy = model.distribute_strategy
            logs = strategy.run(step, args=(data,))
            return reduce_logs(logs, strategy)

        if model.run_eagerly:
            return one_step
        compiled = tf.function(
            one_step,
            reduce_retracing=True,
            jit_compile=model.jit_compile,
            autograph=False,
        )
        return keras_internals.autoconvert_optionals(model, compiled)

    def _batches(self, iterator):
        import tensorflow as tf

        if not isinstance(
            iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)
        ):
            yield from iterator
            return
        while True:
            batch = iterator.get_next_as_optional()
            if not batch.has_value():
                return
            yield batch.get_value()

    def __call__(self, iterator):
        import tensorflow as tf

        optimizer = self.model.optimizer
        if self._step is None:
            self._step = int(numpy_value(optimizer.micro_steps))
        freeze = optimizer.grad_freeze
        logs = None
        batches = self._batches(iterator)
        for _, data in zip(range(self.model.steps_per_execution), batches):
            group = 0 if freeze is None else freeze.group_at(self._step)
            step = self._variant(group, optimizer.applies_at(self._step))
            logs = step(data)
            self._step += 1
        if logs is None:
            raise tf.errors.OutOfRangeError(None, None, "End of data.")
        return logs
