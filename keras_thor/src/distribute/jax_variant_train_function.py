"""One `model.train_function` for training steps of a few kinds (variants)
on JAX, each compiled on its own and chosen in Python before each step."""

import contextlib

import keras

from keras_thor.src.distribute.variant_train_function import VariantHooks


def state_variables(model):
    """The variables of Keras's JAX training state, in its order:
    `(trainable, non-trainable, optimizer, metrics)`."""
    return (
        list(model.trainable_variables),
        list(model.non_trainable_variables),
        list(model.optimizer.variables),
        list(model.metrics_variables),
    )


def batch_rows(data):
    """The leading dimension of the first input of the batch `data`."""
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    for value in keras.tree.flatten(x):
        if value is not None and getattr(value, "shape", None):
            return int(value.shape[0])
    return None


class JaxVariantTrainFunction(VariantHooks):
    """`model.train_function` on JAX whose every step runs one of a few
    variants (`VariantHooks`, JAX's plumbing).

    Keras's JAX `fit` calls it as `train_function(state, iterator)` and
    takes back `(logs, state)`, the state being the values of
    `state_variables(model)`. Each variant is a pure function of the state
    and a batch: the stateful step (`variant_step(key)`) runs inside a
    `keras.StatelessScope` holding the state, and every variable it
    assigns comes back as the new state. Each is compiled once
    (`jax.jit`, the state donated as Keras's own; not under `run_eagerly`
    or `jit_compile=False`), retraced only for a new batch shape.

    Each call runs `model.steps_per_execution` steps (fewer at the end of
    the data), one compiled call each, as Keras's own JAX train function.
    The step count is read from the state (`read_step()` inside
    `state_values()`) at the start of each `fit` (`resync`) and before
    every step while `recounts()`; otherwise it is counted in Python.
    Between steps the variables themselves hold no value (Keras's `fit`
    purges them, and the state it passes is donated): host reads go
    through `state_values()`.
    """

    def __init__(self, model):
        super().__init__(model)
        self._state = None

    @contextlib.contextmanager
    def state_values(self):
        """A context in which the optimizer's variables read as the latest
        training state, and what is assigned to them goes into it (the
        variables themselves, outside a call)."""
        if self._state is None:
            yield
            return
        variables = self.model.optimizer.variables
        with keras.StatelessScope(
            state_mapping=list(zip(variables, self._state[2]))
        ) as scope:
            yield
        import jax

        trainable, non_trainable, values, metrics = self._state
        values = [
            value
            if scope.get_current_value(v) is value
            # Assigned: laid out as the value it replaces (replicated
            # under `keras.distribution`).
            else jax.device_put(scope.get_current_value(v), value.sharding)
            for v, value in zip(variables, values)
        ]
        self._state = (trainable, non_trainable, values, metrics)

    def batch_rows(self, data):
        return batch_rows(data)

    def __call__(self, state, iterator):
        self._state = state
        logs = None
        for _ in range(self.model.steps_per_execution):
            try:
                data = next(iterator)
            except StopIteration:
                if logs is None:
                    raise
                break
            step = self._current_step()
            self.check_covers(step + 1)
            key = self.variant_at(step)
            logs = self.call_variant(
                key, lambda data, key=key: self._run(key, data), data
            )
            self._step = step + 1
        state, self._state = self._state, None
        return logs, state

    def _current_step(self):
        if self._step is None or self.recounts():
            self._step = self.read_step()
        return self._step

    def _run(self, key, data):
        if key not in self._variants:
            self._variants[key] = self._compile(
                self.variant_step(key), self._state
            )
        logs, self._state = self._variants[key](self._state, data)
        return logs

    def _compile(self, step, state):
        """`step` as a pure function of `(state, data)`, compiled; under a
        `keras.distribution` the new state keeps the layout of `state`
        (as Keras's own JAX train function keeps its variables')."""
        model = self.model

        def stateless_step(state, data):
            variables = state_variables(model)
            mapping = [
                (variable, value)
                for group, values in zip(variables, state)
                for variable, value in zip(group, values)
            ]
            with keras.StatelessScope(state_mapping=mapping) as scope:
                logs = step(data)
            new_state = tuple(
                [scope.get_current_value(variable) for variable in group]
                for group in variables
            )
            return logs, new_state

        if model.run_eagerly or not model.jit_compile:
            return stateless_step
        import jax

        out_shardings = None
        if keras.distribution.distribution() is not None:
            out_shardings = (
                None,
                jax.tree_util.tree_map(lambda value: value.sharding, state),
            )
        return jax.jit(
            stateless_step, donate_argnums=0, out_shardings=out_shardings
        )
