"""THOR's documented per-block rule in NumPy float64 (docs/thor.md).

Independent of keras_thor: each layer is written out as matrices by hand
(conv patches from `tests/thor/patches_test.brute_force_patches`), and one
THOR step at fresh factors is, per group `j`:

```
A_j = X_jᵀX_j / rows,  G_j = D_jᵀD_j / rows    (D = N · dL/dz, per sample)
d_j = blocks of (c·A_j + √λ·I)⁻¹ · g_j · blocks of (c·G_j + √λ·I)⁻¹
w_j ← w_j − lr · d_j                          (momentum 0)
```

Notation:
    - `X_j`: group `j`'s input rows (Dense inputs, conv patches);
      `dL/dz`: the gradient of the mean loss at the pre-activation output,
      in the same rows; `g_j = X_jᵀ · dL/dz_j`, the kernel gradient.
    - `c`: `√T` for a convolution with `T` output positions, else 1.
    - "blocks of": the diagonal blocks of `split_dim` (off-diagonal blocks
      dropped), each inverted; the whole inverse when `d ≤ split_dim`.
"""

import math

import numpy as np

from tests.thor.patches_test import brute_force_patches


def mse_output_grad(z, y):
    """`dL/dz` of Keras's `"mse"`: the mean over every element of `z`."""
    return 2.0 * (z - y) / z.size


def damped_inverse(factor, root, split_dim):
    """The block-diagonal inverse of `factor + root·I` (dense, `(d, d)`).

    The last block is as wide as what is left; padding it with identity
    (THOR's layout) does not change its inverse's top-left corner.
    """
    dim = factor.shape[0]
    damped = factor + root * np.eye(dim)
    inverse = np.zeros_like(damped)
    for start in range(0, dim, split_dim):
        block = slice(start, min(start + split_dim, dim))
        inverse[block, block] = np.linalg.inv(damped[block, block])
    return inverse


def loss_terms(z):
    """The terms Keras's losses average for a prediction `z`: every axis
    but the last (`N` for `(N, d)`, `N·L` for `(N, L, d)`)."""
    if z.ndim < 3:
        return z.shape[0]
    return z.size // z.shape[-1]


def kronecker_direction(x_rows, dz_rows, terms, scale, damping, split_dim):
    """`A⁻¹ · g · G⁻¹` of one group from its rows.

    `x_rows` `(R, d_in)`, `dz_rows` `(R, d_out)` the mean-loss output
    gradients; `terms` the loss terms (`loss_terms`) that make them
    per-sample.
    """
    rows = x_rows.shape[0]
    per_sample = dz_rows * terms
    a = x_rows.T @ x_rows / rows
    g = per_sample.T @ per_sample / rows
    root = math.sqrt(damping)
    gradient = x_rows.T @ dz_rows
    return (
        damped_inverse(scale * a, root, split_dim)
        @ gradient
        @ damped_inverse(scale * g, root, split_dim)
    )


def conv_rows(x, kernel_size, strides, dilation_rate, padding, groups):
    """`(per-group patch rows, out_spatial)` of a channels-last conv.

    Group `j`'s rows are `(N·T, K·cin_g)` in `(k_1, ..., k_r, cin_g)`
    order, taking input channels `j·cin_g ... (j+1)·cin_g - 1`.
    """
    patches = brute_force_patches(
        x, kernel_size, strides, dilation_rate, padding
    )
    out_spatial = patches.shape[1:-2]
    taps, channels = patches.shape[-2:]
    cin = channels // groups
    patches = patches.reshape(-1, taps, groups, cin)
    rows = [patches[:, :, j, :].reshape(-1, taps * cin) for j in range(groups)]
    return rows, out_spatial


def group_matrices(kernel, groups):
    """A grouped conv kernel `(k.., cin_g, C_out)` as `(K·cin_g, cout_g)`
    matrices, one per group (output channels `j·cout_g ...`)."""
    taps = math.prod(kernel.shape[:-2])
    cin, cout = kernel.shape[-2:]
    size = cout // groups
    flat = kernel.reshape(taps, cin, cout)
    return [
        flat[:, :, j * size : (j + 1) * size].reshape(taps * cin, size)
        for j in range(groups)
    ]


def kernel_from_groups(matrices, shape):
    """The inverse of `group_matrices`."""
    taps, cin = math.prod(shape[:-2]), shape[-2]
    flat = [m.reshape(taps, cin, m.shape[-1]) for m in matrices]
    return np.concatenate(flat, axis=-1).reshape(shape)


def grouped_forward(rows, matrices, out_shape):
    """`z` `(N, *out_spatial, C_out)`: each group's rows times its matrix."""
    outputs = [r @ m for r, m in zip(rows, matrices)]
    return np.concatenate(outputs, axis=-1).reshape(*out_shape, -1)


def grouped_step(rows, matrices, dz, terms, scale, hyper):
    """The new matrices of every group after one THOR step.

    `dz` `(N, ..., C_out)`, the mean-loss output gradient; `hyper` is
    `(learning_rate, damping, split_dim)`.
    """
    learning_rate, damping, split_dim = hyper
    dz = dz.reshape(-1, dz.shape[-1])
    size = dz.shape[-1] // len(rows)
    new = []
    for j, (x_rows, matrix) in enumerate(zip(rows, matrices)):
        direction = kronecker_direction(
            x_rows,
            dz[:, j * size : (j + 1) * size],
            terms,
            scale,
            damping,
            split_dim,
        )
        new.append(matrix - learning_rate * direction)
    return new


def grouped_gradients(rows, dz):
    """Each group's kernel gradient `X_jᵀ · dL/dz_j` (mean loss)."""
    dz = dz.reshape(-1, dz.shape[-1])
    size = dz.shape[-1] // len(rows)
    return [
        x_rows.T @ dz[:, j * size : (j + 1) * size]
        for j, x_rows in enumerate(rows)
    ]


def depthwise_as_grouped(kernel):
    """A depthwise kernel `(k.., C, m)` as the grouped kernel
    `(k.., 1, C·m)` (`groups = C`; output channel `c·m + i`)."""
    *window, channels, multiplier = kernel.shape
    return kernel.reshape(*window, 1, channels * multiplier)


def layer_norm(x, gamma, beta, epsilon):
    """`(y, x̂)` of LayerNormalization on the last axis."""
    mean = x.mean(axis=-1, keepdims=True)
    variance = x.var(axis=-1, keepdims=True)
    normalized = (x - mean) / np.sqrt(variance + epsilon)
    return normalized * gamma + beta, normalized


def layer_norm_direction(gradient, damping, batch_size):
    """MindSpore's LayerNorm rule `g / (g² / N_b + √λ)`."""
    return gradient / (gradient**2 / batch_size + math.sqrt(damping))
