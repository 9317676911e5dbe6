"""One `model.fit` step of THOR against NumPy, one layer kind at a time.

Each test trains a model holding one layer (linear activation) for one
step on one batch of `N` examples with MSE, momentum 0 and `frequency=2`:
step 0 refreshes the curvature, so it preconditions with the factors of
its own batch. The expected weights come from `tests/thor/block_reference`,
THOR's documented rule (docs/thor.md) written out in float64 NumPy from the
layer's matrices alone; a bias moves by plain SGD.
"""

import keras
import numpy as np
import pytest

import keras_thor
from tests.thor import block_reference as ref

pytestmark = pytest.mark.thor_training

N = 6
LEARNING_RATE = 0.1
DAMPING = 0.01
SPLIT_DIM = 512
HYPER = (LEARNING_RATE, DAMPING, SPLIT_DIM)


@keras.saving.register_keras_serializable("block_reference_test")
class MyDense(keras.layers.Dense):
    """A user's Dense that keeps `Dense.call`."""


def _np(value):
    return keras.ops.convert_to_numpy(value).astype("float64")


def _data(rng, shape):
    return rng.normal(size=shape).astype("float32")


def _thor_model(layers, convert):
    if convert:
        return keras_thor.convert_to_thor_model(keras.Sequential(layers))
    return keras_thor.models.ThorSequential(layers)


def _fit(model, x, y, split_dim=SPLIT_DIM, **thor_kwargs):
    model.compile(
        optimizer=keras_thor.optimizers.THOR(
            learning_rate=LEARNING_RATE,
            damping=DAMPING,
            momentum=0.0,
            frequency=2,
            split_dim=split_dim,
            **thor_kwargs,
        ),
        loss="mse",
    )
    model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)


def _check_forward(model, x, z):
    """The NumPy reading of the layer is the layer."""
    np.testing.assert_allclose(_np(model(x)), z, rtol=1e-5, atol=1e-5)


def _assert_step(variable, before, expected, sgd=None):
    """`variable` moved from `before` to `expected` (and not by SGD)."""
    assert not np.allclose(expected, before, rtol=1e-3, atol=1e-4)
    if sgd is not None:
        assert not np.allclose(expected, sgd, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(_np(variable), expected, rtol=1e-4, atol=1e-6)


def _dense_case(layer, x, convert, **thor_kwargs):
    """A Dense layer with a bias, one step; returns nothing."""
    rng = np.random.default_rng(1)
    model = _thor_model([keras.Input(x.shape[1:]), layer], convert)
    layer = model.layers[0]
    kernel, bias = _np(layer.kernel), _np(layer.bias)
    z = x.astype("float64") @ kernel + bias
    _check_forward(model, x, z)
    y = _data(rng, z.shape)
    dz = ref.mse_output_grad(z, y.astype("float64"))
    [expected] = ref.grouped_step(
        [x.astype("float64")], [kernel], dz, ref.loss_terms(z), 1.0, HYPER
    )
    _fit(model, x, y, **thor_kwargs)
    sgd = kernel - LEARNING_RATE * x.T @ dz
    _assert_step(layer.kernel, kernel, expected, sgd)
    _assert_step(layer.bias, bias, bias - LEARNING_RATE * dz.sum(axis=0))


@pytest.mark.parametrize(
    "dense_class, convert",
    [(keras.layers.Dense, False), (MyDense, False), (MyDense, True)],
    ids=["Dense", "subclass", "subclass-converted"],
)
def test_dense(dense_class, convert):
    x = _data(np.random.default_rng(0), (N, 5))
    layer = dense_class(3, bias_initializer="random_normal")
    _dense_case(layer, x, convert)


def test_dense_in_the_factored_order():
    """A wide Dense layer at a small `batch_size` takes `(A⁻¹Xᵀ)(D·G⁻¹)`."""
    x = _data(np.random.default_rng(0), (N, 24))
    layer = keras.layers.Dense(24, bias_initializer="random_normal")
    _dense_case(layer, x, False, batch_size=N)


def test_dense_with_factors_cut_into_blocks():
    """Dense 6 -> 10 at `split_dim=4`: A in blocks 4+2, G in 4+4+2."""
    rng = np.random.default_rng(2)
    x = _data(rng, (N, 6))
    model = keras_thor.models.ThorSequential(
        [keras.Input((6,)), keras.layers.Dense(10, use_bias=False)]
    )
    kernel = _np(model.layers[0].kernel)
    z = x.astype("float64") @ kernel
    y = _data(rng, z.shape)
    dz = ref.mse_output_grad(z, y.astype("float64"))
    rows = [x.astype("float64")]
    [expected] = ref.grouped_step(
        rows, [kernel], dz, N, 1.0, (LEARNING_RATE, DAMPING, 4)
    )
    [unsplit] = ref.grouped_step(rows, [kernel], dz, N, 1.0, HYPER)
    _fit(model, x, y, split_dim=4)
    _assert_step(model.layers[0].kernel, kernel, expected, unsplit)


def _conv_case(layer, x, options, groups, convert=False, depthwise=False):
    """A conv layer `(kernel_size, strides, dilation_rate, padding)`."""
    rng = np.random.default_rng(3)
    model = _thor_model([keras.Input(x.shape[1:]), layer], convert)
    layer = model.layers[0]
    kernel = _np(layer.kernel)
    grouped = ref.depthwise_as_grouped(kernel) if depthwise else kernel
    rows, out_spatial = ref.conv_rows(x, *options, groups)
    matrices = ref.group_matrices(grouped, groups)
    z = ref.grouped_forward(rows, matrices, (N, *out_spatial))
    bias = _np(layer.bias) if layer.use_bias else 0.0
    _check_forward(model, x, z + bias)
    y = _data(rng, z.shape)
    dz = ref.mse_output_grad(z + bias, y.astype("float64"))
    scale = np.sqrt(np.prod(out_spatial))
    new = ref.grouped_step(rows, matrices, dz, ref.loss_terms(z), scale, HYPER)
    expected = ref.kernel_from_groups(new, grouped.shape).reshape(kernel.shape)
    sgd = ref.kernel_from_groups(
        [
            m - LEARNING_RATE * g
            for m, g in zip(matrices, ref.grouped_gradients(rows, dz))
        ],
        grouped.shape,
    ).reshape(kernel.shape)
    _fit(model, x, y)
    _assert_step(layer.kernel, kernel, expected, sgd)
    if layer.use_bias:
        summed = dz.reshape(-1, dz.shape[-1]).sum(axis=0)
        _assert_step(layer.bias, bias, bias - LEARNING_RATE * summed)


@pytest.mark.parametrize(
    "padding, strides, dilation",
    [("causal", 2, 1), ("same", 2, 1), ("causal", 1, 2)],
)
def test_conv1d(padding, strides, dilation):
    x = _data(np.random.default_rng(0), (N, 7, 2))
    layer = keras.layers.Conv1D(
        3,
        3,
        strides=strides,
        dilation_rate=dilation,
        padding=padding,
        bias_initializer="random_normal",
    )
    _conv_case(layer, x, ((3,), (strides,), (dilation,), padding), 1)


def test_grouped_conv2d_has_a_block_per_group():
    x = _data(np.random.default_rng(0), (N, 5, 4, 4))
    layer = keras.layers.Conv2D(
        4, (2, 3), strides=(1, 2), padding="same", groups=2, use_bias=False
    )
    options = ((2, 3), (1, 2), (1, 1), "same")
    _conv_case(layer, x, options, 2, convert=True)


def test_conv3d():
    x = _data(np.random.default_rng(0), (N, 3, 4, 3, 2))
    layer = keras.layers.Conv3D(
        2, (2, 2, 2), strides=(1, 2, 1), padding="same", use_bias=False
    )
    options = ((2, 2, 2), (1, 2, 1), (1, 1, 1), "same")
    _conv_case(layer, x, options, 1)


def test_depthwise_conv2d():
    x = _data(np.random.default_rng(0), (N, 5, 5, 2))
    layer = keras.layers.DepthwiseConv2D(
        (3, 3), strides=2, padding="same", depth_multiplier=2, use_bias=False
    )
    options = ((3, 3), (2, 2), (1, 1), "same")
    _conv_case(layer, x, options, 2, depthwise=True)


def test_depthwise_conv1d():
    x = _data(np.random.default_rng(0), (N, 8, 3))
    layer = keras.layers.DepthwiseConv1D(
        3, dilation_rate=2, padding="valid", use_bias=False
    )
    _conv_case(layer, x, ((3,), (1,), (2,), "valid"), 3, depthwise=True)


def test_separable_conv2d_moves_both_kernels():
    """Depthwise block on the input, pointwise 1x1 block on its output."""
    rng = np.random.default_rng(4)
    x = _data(rng, (N, 5, 5, 2))
    model = keras_thor.models.ThorSequential(
        [
            keras.Input((5, 5, 2)),
            keras.layers.SeparableConv2D(
                3,
                (2, 2),
                padding="same",
                depth_multiplier=2,
                bias_initializer="random_normal",
            ),
        ]
    )
    layer = model.layers[0]
    depthwise, pointwise = (
        _np(layer.depthwise_kernel),
        _np(layer.pointwise_kernel),
    )
    bias = _np(layer.bias)
    grouped = ref.depthwise_as_grouped(depthwise)
    rows, out_spatial = ref.conv_rows(
        x, (2, 2), (1, 1), (1, 1), "same", groups=2
    )
    matrices = ref.group_matrices(grouped, 2)
    middle = ref.grouped_forward(rows, matrices, (N * 25,))
    pointwise_matrix = pointwise.reshape(4, 3)
    z = (middle @ pointwise_matrix + bias).reshape(N, 5, 5, 3)
    _check_forward(model, x, z)
    y = _data(rng, z.shape)
    dz = ref.mse_output_grad(z, y.astype("float64")).reshape(-1, 3)
    scale = np.sqrt(np.prod(out_spatial))
    terms = ref.loss_terms(z)
    new = ref.grouped_step(
        rows, matrices, dz @ pointwise_matrix.T, terms, scale, HYPER
    )
    [new_pointwise] = ref.grouped_step(
        [middle], [pointwise_matrix], dz, terms, scale, HYPER
    )
    _fit(model, x, y)
    expected = ref.kernel_from_groups(new, grouped.shape)
    _assert_step(
        layer.depthwise_kernel, depthwise, expected.reshape(depthwise.shape)
    )
    _assert_step(
        layer.pointwise_kernel,
        pointwise,
        new_pointwise.reshape(pointwise.shape),
    )
    _assert_step(layer.bias, bias, bias - LEARNING_RATE * dz.sum(axis=0))


@pytest.mark.parametrize(
    "equation, input_shape, kernel_shape, output_shape",
    [
        ("abc,cde->abde", (3, 4), (4, 2, 3), (3, 2, 3)),
        ("abcd,cde->abe", (3, 2, 4), (2, 4, 3), (3, 3)),
    ],
    ids=["abc,cde->abde", "abcd,cde->abe"],
)
def test_einsum_dense(equation, input_shape, kernel_shape, output_shape):
    """Rows are (example, sequence position); the kernel is (in, out)."""
    rng = np.random.default_rng(5)
    x = _data(rng, (N, *input_shape))
    model = keras_thor.models.ThorSequential(
        [
            keras.Input(input_shape),
            keras.layers.EinsumDense(equation, output_shape),
        ]
    )
    layer = model.layers[0]
    kernel = _np(layer.kernel)
    assert kernel.shape == kernel_shape
    d_in = np.prod(x.shape[2:])
    rows = x.astype("float64").reshape(N * input_shape[0], d_in)
    matrix = kernel.reshape(d_in, -1)
    z = (rows @ matrix).reshape(N, *output_shape)
    _check_forward(model, x, z)
    y = _data(rng, z.shape)
    dz = ref.mse_output_grad(z, y.astype("float64"))
    dz = dz.reshape(rows.shape[0], -1)
    [new] = ref.grouped_step(
        [rows], [matrix], dz, ref.loss_terms(z), 1.0, HYPER
    )
    _fit(model, x, y)
    sgd = matrix - LEARNING_RATE * rows.T @ dz
    _assert_step(
        layer.kernel,
        kernel,
        new.reshape(kernel_shape),
        sgd.reshape(kernel_shape),
    )


def test_embedding_uses_the_diagonal_input_factor():
    """`diag(1 / (counts/rows + √λ)) · g · G⁻¹`; an unused id stays."""
    rng = np.random.default_rng(6)
    vocabulary, width, length = 7, 4, 3
    ids = rng.integers(0, vocabulary - 1, size=(N, length)).astype("int32")
    model = keras_thor.models.ThorSequential(
        [
            keras.Input((length,), dtype="int32"),
            keras.layers.Embedding(vocabulary, width),
        ]
    )
    table = _np(model.layers[0].embeddings)
    one_hot = np.eye(vocabulary)[ids.reshape(-1)]
    z = (one_hot @ table).reshape(N, length, width)
    _check_forward(model, ids, z)
    y = _data(rng, z.shape)
    dz = ref.mse_output_grad(z, y.astype("float64")).reshape(-1, width)
    rows = one_hot.shape[0]
    counts = one_hot.sum(axis=0)
    per_sample = dz * ref.loss_terms(z)
    g_inverse = ref.damped_inverse(
        per_sample.T @ per_sample / rows, np.sqrt(DAMPING), SPLIT_DIM
    )
    gradient = one_hot.T @ dz
    direction = (gradient / (counts / rows + np.sqrt(DAMPING))[:, None]) @ (
        g_inverse
    )
    expected = table - LEARNING_RATE * direction
    _fit(model, ids, y)
    np.testing.assert_array_equal(expected[-1], table[-1])
    _assert_step(
        model.layers[0].embeddings,
        table,
        expected,
        table - LEARNING_RATE * gradient,
    )


def test_layer_normalization_uses_the_diagonal_rule():
    """`g / (g² / batch_size + √λ)` for gamma and beta, `batch_size` 32
    (THOR's argument when given, not the batch); the Dense after it as
    Dense."""
    rng = np.random.default_rng(7)
    x = _data(rng, (N, 5))
    model = keras_thor.models.ThorSequential(
        [
            keras.Input((5,)),
            keras.layers.LayerNormalization(
                gamma_initializer="random_normal",
                beta_initializer="random_normal",
            ),
            keras.layers.Dense(3, use_bias=False),
        ]
    )
    norm, dense = model.layers
    gamma, beta, kernel = _np(norm.gamma), _np(norm.beta), _np(dense.kernel)
    normalized_out, normalized = ref.layer_norm(
        x.astype("float64"), gamma, beta, norm.epsilon
    )
    z = normalized_out @ kernel
    _check_forward(model, x, z)
    y = _data(rng, z.shape)
    dz = ref.mse_output_grad(z, y.astype("float64"))
    d_norm = dz @ kernel.T
    gamma_grad = (d_norm * normalized).sum(axis=0)
    beta_grad = d_norm.sum(axis=0)
    [new_kernel] = ref.grouped_step(
        [normalized_out], [kernel], dz, N, 1.0, HYPER
    )
    with pytest.warns(UserWarning, match="batch_size=32"):
        _fit(model, x, y, batch_size=32)
    for variable, before, gradient in (
        (norm.gamma, gamma, gamma_grad),
        (norm.beta, beta, beta_grad),
    ):
        direction = ref.layer_norm_direction(gradient, DAMPING, 32)
        _assert_step(
            variable,
            before,
            before - LEARNING_RATE * direction,
            before - LEARNING_RATE * gradient,
        )
    _assert_step(dense.kernel, kernel, new_kernel)


def test_tied_embedding_takes_curvature_from_the_lookup_and_the_head():
    """`ReversibleEmbedding(tie_weights=True)` used as lookup and head:
    `(diag(a) + G_head + √λ)⁻¹ · g · (G_lookup + A_head + √λ)⁻¹`, each
    use's factors the mean over its own rows, `g` both uses' gradient."""
    rng = np.random.default_rng(8)
    vocabulary, width, length = 6, 4, 3
    ids = rng.integers(0, vocabulary, size=(N, length)).astype("int32")
    inputs = keras.Input((length,), dtype="int32")
    layer = keras.layers.ReversibleEmbedding(vocabulary, width)
    model = keras_thor.models.ThorModel(
        inputs, layer(layer(inputs), reverse=True)
    )
    table = _np(layer.embeddings)
    one_hot = np.eye(vocabulary)[ids.reshape(-1)]
    x_rows = one_hot @ table
    z = (x_rows @ table.T).reshape(N, length, vocabulary)
    _check_forward(model, ids, z)
    y = _data(rng, z.shape)
    dz = ref.mse_output_grad(z, y.astype("float64")).reshape(-1, vocabulary)
    dx = dz @ table
    rows, terms = x_rows.shape[0], ref.loss_terms(z)
    head_grads, lookup_grads = dz * terms, dx * terms
    left = np.diag(one_hot.sum(axis=0) / rows) + (
        head_grads.T @ head_grads / rows
    )
    right = (lookup_grads.T @ lookup_grads + x_rows.T @ x_rows) / rows
    gradient = one_hot.T @ dx + dz.T @ x_rows
    root = np.sqrt(DAMPING)
    direction = (
        ref.damped_inverse(left, root, SPLIT_DIM)
        @ gradient
        @ ref.damped_inverse(right, root, SPLIT_DIM)
    )
    _fit(model, ids, y)
    _assert_step(
        layer.embeddings,
        table,
        table - LEARNING_RATE * direction,
        table - LEARNING_RATE * gradient,
    )


def test_untied_reversible_embedding_takes_the_dense_rule_before_the_cap():
    """Untied: the lookup as an Embedding, the `(W, V)` reverse kernel as
    a Dense layer whose outputs are the logits before `logit_soft_cap`."""
    rng = np.random.default_rng(9)
    vocabulary, width, length, cap = 6, 4, 3, 2.0
    ids = rng.integers(0, vocabulary, size=(N, length)).astype("int32")
    inputs = keras.Input((length,), dtype="int32")
    layer = keras.layers.ReversibleEmbedding(
        vocabulary,
        width,
        tie_weights=False,
        logit_soft_cap=cap,
        embeddings_initializer="random_normal",
    )
    model = keras_thor.models.ThorModel(
        inputs, layer(layer(inputs), reverse=True)
    )
    table, reverse = _np(layer.embeddings), _np(layer.reverse_embeddings)
    one_hot = np.eye(vocabulary)[ids.reshape(-1)]
    x_rows = one_hot @ table
    capped = np.tanh(x_rows @ reverse / cap)
    z = (cap * capped).reshape(N, length, vocabulary)
    _check_forward(model, ids, z)
    y = _data(rng, z.shape)
    dz = ref.mse_output_grad(z, y.astype("float64")).reshape(-1, vocabulary)
    dz_logits = dz * (1.0 - capped**2)
    terms = ref.loss_terms(z)
    [expected_reverse] = ref.grouped_step(
        [x_rows], [reverse], dz_logits, terms, 1.0, HYPER
    )
    dx = dz_logits @ reverse.T
    rows = x_rows.shape[0]
    per_sample = dx * terms
    g_inverse = ref.damped_inverse(
        per_sample.T @ per_sample / rows, np.sqrt(DAMPING), SPLIT_DIM
    )
    gradient = one_hot.T @ dx
    counts = one_hot.sum(axis=0) / rows
    direction = (gradient / (counts + np.sqrt(DAMPING))[:, None]) @ g_inverse
    _fit(model, ids, y)
    _assert_step(
        layer.reverse_embeddings,
        reverse,
        expected_reverse,
        reverse - LEARNING_RATE * x_rows.T @ dz_logits,
    )
    _assert_step(
        layer.embeddings,
        table,
        table - LEARNING_RATE * direction,
        table - LEARNING_RATE * gradient,
    )
