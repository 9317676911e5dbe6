"""The new values a THOR step gives its state, written in one place.

A step computes its curvature state (inverses, averaged factors, counters,
trace-rule and guard state) as values into a `StateWrites`, reads back
what it has computed through `value`, and `write` assigns what is
pending: the values a backend whose step returns its new state (Keras's
stateless JAX step) would return instead. THOR's TensorFlow step writes
after the refresh and again after the direction stage: assignments
issued early run beside the rest of the step (docs/benchmarks.md,
"THOR's step cost").
"""

from keras import ops


class StateWrites:
    """Pending assignments and increments of THOR's state variables."""

    def __init__(self):
        self._values = {}
        self._increments = {}

    def set(self, variable, value):
        """`variable ← value` when written."""
        assert id(variable) not in self._increments, variable.path
        self._values[id(variable)] = (variable, value)

    def add(self, variable, increment):
        """`variable ← variable + increment` when written (increments of
        one variable add up)."""
        assert id(variable) not in self._values, variable.path
        if id(variable) in self._increments:
            increment = increment + self._increments[id(variable)][1]
        self._increments[id(variable)] = (variable, increment)

    def value(self, variable):
        """`variable`'s value after the writes: its set value, or its
        current value plus its increments."""
        if id(variable) in self._values:
            return self._values[id(variable)][1]
        value = ops.convert_to_tensor(variable)
        if id(variable) in self._increments:
            value = value + self._increments[id(variable)][1]
        return value

    def write(self, assign, assign_add):
        """Writes every pending value through `assign` and every increment
        through `assign_add` (the optimizer's, so writes follow its
        distribution rules), then forgets them: later reads see the
        variables."""
        for variable, value in self._values.values():
            assign(variable, value)
        for variable, increment in self._increments.values():
            assign_add(variable, ops.cast(increment, variable.dtype))
        self._values, self._increments = {}, {}
