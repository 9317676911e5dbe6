"""EinsumDense as a Dense layer on rows: layouts against real layers."""

import math
import re

import keras
import numpy as np
import pytest

from keras_thor.src.thor import einsum_layout as layouts
from tests import helpers

# (equation, output_shape, input shape): MultiHeadAttention's projections
# and the forms EinsumDense documents.
EQUATIONS = [
    ("ab,bc->ac", 4, (3, 5)),
    ("...b,bc->...c", 4, (2, 3, 5)),
    ("...b,bc->...c", 4, (3, 5)),
    ("ab...,bc->ac...", (4, None), (2, 3, 5)),
    ("abc,cde->abde", (None, 2, 3), (2, 3, 4)),
    ("abcd,cde->abe", (None, 5), (2, 3, 2, 4)),
    ("abcd,def->abcef", (None, None, 2, 3), (2, 3, 2, 4)),
    ("abc,bcd->ad", 4, (2, 3, 5)),
    ("abc,cd->abd", (None, 4), (2, 3, 5)),
]


def _layer(equation, output_shape, input_shape):
    layer = keras.layers.EinsumDense(equation, output_shape)
    x = np.random.normal(size=input_shape).astype("float32")
    return layer, x, layer(x)


@pytest.mark.parametrize("equation, output_shape, input_shape", EQUATIONS)
def test_rows_times_the_kernel_matrix_are_the_layer(
    equation, output_shape, input_shape
):
    layer, x, y = _layer(equation, output_shape, input_shape)
    layout = layouts.einsum_layout(equation, len(input_shape))
    d_in, d_out = layout.dims(layer.kernel.shape)
    x_rows = keras.ops.convert_to_numpy(layout.input_rows(x))
    y_rows = keras.ops.convert_to_numpy(layout.output_rows(y))
    kernel = layout.kernel_matrix(layer.kernel)
    assert x_rows.shape[1] == d_in and kernel.shape == (d_in, d_out)
    assert x_rows.shape[0] * d_out == y_rows.size
    assert x_rows.shape[0] * d_in == x.size
    kernel = keras.ops.convert_to_numpy(kernel).astype("float64")
    np.testing.assert_allclose(
        x_rows.astype("float64") @ kernel, y_rows, rtol=1e-5, atol=1e-5
    )
    back = layout.kernel_from_matrix(kernel, layer.kernel.shape)
    np.testing.assert_array_equal(
        back, keras.ops.convert_to_numpy(layer.kernel)
    )


def test_rows_follow_the_documented_letter_order():
    # "abcd,dbe->ace": batch a, c (input order); contracted d, b (kernel
    # order); free e.
    x = np.random.normal(size=(2, 3, 4, 5))
    y = np.random.normal(size=(2, 4, 6))
    layout = layouts.einsum_layout("abcd,dbe->ace", 4)
    assert (layout.batch, layout.contracted, layout.free) == ("ac", "db", "e")
    np.testing.assert_array_equal(
        layout.input_rows(x), x.transpose(0, 2, 3, 1).reshape(8, 15)
    )
    np.testing.assert_array_equal(layout.output_rows(y), y.reshape(8, 6))
    kernel = np.random.normal(size=(5, 3, 6))
    np.testing.assert_array_equal(
        layout.kernel_matrix(kernel), kernel.reshape(15, 6)
    )


def test_kernel_gradient_is_input_rows_times_output_gradient_rows():
    for equation, output_shape, input_shape in EQUATIONS:
        layer, x, y = _layer(equation, output_shape, input_shape)
        dy = np.random.normal(size=y.shape).astype("float32")
        (grad,) = helpers.vector_jacobian(
            lambda values, layer=layer, x=x: layer.stateless_call(
                values, [], x
            )[0],
            [layer.kernel.value],
            dy,
        )
        layout = layouts.einsum_layout(equation, len(input_shape))
        x_rows = keras.ops.convert_to_numpy(layout.input_rows(x))
        dy_rows = keras.ops.convert_to_numpy(layout.output_rows(dy))
        product = x_rows.astype("float64").T @ dy_rows.astype("float64")
        np.testing.assert_allclose(
            layout.kernel_from_matrix(product, layer.kernel.shape),
            grad,
            rtol=1e-5,
            atol=1e-5,
            err_msg=equation,
        )


def test_batch_letters_may_change_order():
    x = np.random.normal(size=(2, 3, 4)).astype("float32")
    kernel = np.random.normal(size=(4, 5)).astype("float32")
    dy = np.random.normal(size=(3, 2, 5)).astype("float32")
    (grad,) = helpers.vector_jacobian(
        lambda values: keras.ops.einsum("abc,cd->bad", x, values[0]),
        [kernel],
        dy,
    )
    layout = layouts.einsum_layout("abc,cd->bad", 3)
    x_rows, dy_rows = layout.input_rows(x), layout.output_rows(dy)
    np.testing.assert_allclose(
        layout.kernel_from_matrix(
            keras.ops.matmul(keras.ops.transpose(x_rows), dy_rows), (4, 5)
        ),
        grad,
        rtol=1e-5,
        atol=1e-5,
    )


def test_unsupported_equations_give_a_reason():
    for equation, input_rank, reason in [
        ("abc,acd->abd", 3, "'a' is in the input, kernel and output"),
        ("ab,bcd->ac", 2, "'d' is only in the kernel"),
        ("abc,cd->ad", 3, "'b' is only in the input"),
        ("ab,bc->acd", 2, "'d' is only in the output"),
        ("...b,...bc->...c", 3, "'...' in the kernel"),
        ("...b,bc->ac", 3, "'...' must appear"),
        ("aab,bc->ac", 3, "repeats"),
        ("ab,bc", 2, "expected 'input,kernel->output'"),
        ("abc,cd->abd", 2, "rank 2"),
    ]:
        message = layouts.unsupported_reason(equation, input_rank)
        assert reason in message and equation in message, message
        with pytest.raises(
            layouts.UnsupportedEinsumError, match=re.escape(reason)
        ):
            layouts.einsum_layout(equation, input_rank)
    assert issubclass(layouts.UnsupportedEinsumError, ValueError)
    for equation, _, input_shape in EQUATIONS:
        assert layouts.unsupported_reason(equation, len(input_shape)) is None


@pytest.mark.tf_only
def test_rows_with_an_unknown_batch_size():
    import tensorflow as tf

    layout = layouts.einsum_layout("abc,cde->abde", 3)
    signature = [
        tf.TensorSpec([None, None, 4], "float32"),
        tf.TensorSpec([None, None, 2, 3], "float32"),
    ]

    @tf.function(input_signature=signature)
    def rows(inputs, grads):
        x_rows, d_rows = layout.input_rows(inputs), layout.output_rows(grads)
        return x_rows, d_rows, tf.matmul(x_rows, d_rows, transpose_a=True)

    x = np.random.normal(size=(2, 3, 4)).astype("float32")
    d = np.random.normal(size=(2, 3, 2, 3)).astype("float32")
    x_rows, d_rows, product = rows(x, d)
    assert rows.get_concrete_function().structured_outputs[0].shape[-1] == 4
    assert rows.get_concrete_function().structured_outputs[1].shape[-1] == 6
    np.testing.assert_array_equal(x_rows, x.reshape(6, 4))
    np.testing.assert_array_equal(d_rows, d.reshape(6, 6))
    expected = np.einsum("abc,abde->cde", x, d)
    np.testing.assert_allclose(
        layout.kernel_from_matrix(product, (4, 2, 3)),
        expected,
        rtol=1e-5,
        atol=1e-5,
    )
    assert math.prod(layout.dims((4, 2, 3))) == 24


@pytest.mark.parametrize("equation, output_shape, input_shape", EQUATIONS)
def test_rows_per_example_are_the_output_rows_of_one_example(
    equation, output_shape, input_shape
):
    layer, x, y = _layer(equation, output_shape, input_shape)
    layout = layouts.einsum_layout(equation, len(x.shape))
    rows = layout.output_rows(keras.ops.convert_to_tensor(y))
    assert layout.rows_per_example(y.shape) * x.shape[0] == rows.shape[0]
    unknown = (None,) * len(y.shape)
    later_batch_letters = len(layout.batch) > 1
    assert (layout.rows_per_example(unknown) is None) == later_batch_letters
