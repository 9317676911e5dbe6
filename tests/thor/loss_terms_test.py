"""The loss terms per example that make THOR's output gradients per-sample."""

import numpy as np
import pytest
from keras import ops

from keras_thor.src.thor.loss_terms import terms_per_example


@pytest.mark.parametrize(
    "shape, terms",
    [((4,), 1), ((4, 3), 1), ((4, 7, 3), 7), ((4, 5, 6, 3), 30)],
    ids=["scalar-per-example", "classes", "sequence", "pixels"],
)
def test_terms_are_the_axes_between_examples_and_the_last(shape, terms):
    y_pred = ops.convert_to_tensor(np.zeros(shape, "float32"))
    assert int(terms_per_example(y_pred)) == terms


def test_several_outputs_count_the_examples_only():
    y_pred = {
        "tokens": ops.zeros((4, 7, 3)),
        "label": ops.zeros((4, 2)),
    }
    assert terms_per_example(y_pred) == 1
    assert terms_per_example([ops.zeros((4, 7, 3))]) == 7
