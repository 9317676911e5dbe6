"""Argument checks that raise Keras-style `TypeError`/`ValueError`s.

Every message names the argument and the received value, e.g.
"Argument `lambd` must be >= 0. Received: lambd=-1.0".
"""

import math
import numbers

import keras


def _received(name, value):
    return f"Received: {name}={value!r}"


def check_bool(name, value):
    """Returns `value` if it is a Python bool."""
    if not isinstance(value, bool):
        raise TypeError(
            f"Argument `{name}` must be a boolean. "
            f"{_received(name, value)} (of type {type(value).__name__})"
        )
    return value


def check_one_of(name, value, choices):
    """Returns `value` if it is one of `choices` (a tuple)."""
    if value not in choices:
        raise ValueError(
            f"Argument `{name}` must be one of {choices}. "
            f"{_received(name, value)}"
        )
    return value


def check_float(name, value, minimum=None, allow_inf=False, maximum=None):
    """Returns `value` as a float after type and range checks.

    Ints are accepted and converted; bools, strings and other objects are a
    `TypeError`. NaN is always a `ValueError`, infinity unless `allow_inf`.
    With `minimum` (`maximum`), the value must be `>= minimum`
    (`<= maximum`).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"Argument `{name}` must be a float. "
            f"{_received(name, value)} (of type {type(value).__name__})"
        )
    value = float(value)
    if math.isnan(value) or (math.isinf(value) and not allow_inf):
        kind = "a float, not NaN" if allow_inf else "a finite float"
        raise ValueError(
            f"Argument `{name}` must be {kind}. {_received(name, value)}"
        )
    if minimum is not None and value < minimum:
        raise ValueError(
            f"Argument `{name}` must be >= {minimum}. {_received(name, value)}"
        )
    if maximum is not None and value > maximum:
        raise ValueError(
            f"Argument `{name}` must be <= {maximum}. {_received(name, value)}"
        )
    return value


def check_int(name, value, minimum=None):
    """Returns `value` if it is an integer (not a bool) `>= minimum`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"Argument `{name}` must be an integer. "
            f"{_received(name, value)} (of type {type(value).__name__})"
        )
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(
            f"Argument `{name}` must be an integer >= {minimum}. "
            f"{_received(name, value)}"
        )
    return value


def check_learning_rate(value):
    """Accepts a float >= 0, a `LearningRateSchedule` or a callable."""
    name = "learning_rate"
    schedule = keras.optimizers.schedules.LearningRateSchedule
    if isinstance(value, schedule) or callable(value):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"Argument `{name}` must be a float, a "
            "`keras.optimizers.schedules.LearningRateSchedule` or a "
            f"callable. {_received(name, value)} "
            f"(of type {type(value).__name__})"
        )
    return check_float(name, value, minimum=0.0)
