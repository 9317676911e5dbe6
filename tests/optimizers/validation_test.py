"""Every argument's wrong type and out-of-range value is a clear error."""

import re

import pytest

from keras_thor.optimizers import ASGD
from keras_thor.optimizers import SAG
from tests.helpers import stable_id

BAD_ARGUMENTS = [
    # (optimizer, argument, value, error)
    (ASGD, "learning_rate", "fast", TypeError),
    (ASGD, "learning_rate", -0.1, ValueError),
    (ASGD, "learning_rate", float("nan"), ValueError),
    (ASGD, "lambd", "1e-4", TypeError),
    (ASGD, "lambd", True, TypeError),
    (ASGD, "lambd", -1.0, ValueError),
    (ASGD, "alpha", None, TypeError),
    (ASGD, "alpha", -0.5, ValueError),
    (ASGD, "t0", [10], TypeError),
    (ASGD, "t0", -1.0, ValueError),
    (ASGD, "t0", float("nan"), ValueError),
    (ASGD, "weight_decay", "0.1", TypeError),
    (ASGD, "weight_decay", -0.5, ValueError),
    (ASGD, "weight_decay", float("inf"), ValueError),
    (ASGD, "maximize", 1, TypeError),
    (ASGD, "maximize", "yes", TypeError),
    (ASGD, "finalize_with_average", 0, TypeError),
    (SAG, "learning_rate", [0.1], TypeError),
    (SAG, "learning_rate", -1e-3, ValueError),
    (SAG, "batch_num", 2.0, TypeError),
    (SAG, "batch_num", True, TypeError),
    (SAG, "batch_num", "3", TypeError),
    (SAG, "batch_num", 0, ValueError),
    (SAG, "batch_num", -2, ValueError),
    (SAG, "weight_decay", "l2", TypeError),
    (SAG, "weight_decay", -0.1, ValueError),
    (SAG, "multi_precision", 1, TypeError),
    (SAG, "multi_precision", None, TypeError),
]


@pytest.mark.parametrize(
    "optimizer, argument, value, error",
    BAD_ARGUMENTS,
    ids=[f"{o.__name__}-{a}-{stable_id(v)}" for o, a, v, _ in BAD_ARGUMENTS],
)
def test_bad_argument_names_argument_and_value(
    optimizer, argument, value, error
):
    expected = (
        re.escape(f"Argument `{argument}` must be")
        + ".*"
        + re.escape(f"Received: {argument}={value!r}")
    )
    with pytest.raises(error, match=expected):
        optimizer(**{argument: value})


def test_finalize_with_average_and_use_ema_conflict():
    with pytest.raises(ValueError, match="`finalize_with_average`"):
        ASGD(finalize_with_average=True, use_ema=True)


@pytest.mark.parametrize("value", [0, 5, 2.5, float("inf")])
def test_valid_t0_values_are_accepted(value):
    assert ASGD(t0=value).t0 == float(value)


def test_int_arguments_convert_to_float():
    optimizer = ASGD(lambd=0, alpha=1, weight_decay=0)
    assert isinstance(optimizer.lambd, float)
    assert isinstance(optimizer.alpha, float)
