"""Curvature statistics of N-D, grouped and depthwise convolutions.

A convolution with `groups` groups is `groups` independent Dense layers on
im2col patches, one per group: group `g` multiplies the patch entries of its
own input channels by its own kernel columns. THOR keeps one pair of
factors per group, so the statistics come per group, stacked.

Notation:
    - `r`: the spatial rank; `K = k_1 ··· k_r`, the kernel's taps.
    - `C_in = groups · cin_g`, `C_out = groups · cout_g`; input channel `c`
      is in group `c // cin_g`, output channel `o` in group `o // cout_g`
      (Keras's grouped `Conv`, kernel `(k_1, ..., k_r, cin_g, C_out)`).
    - `M_g`: the patches of group `g`, one row per (example, output
      position), flattened in `(k_1, ..., k_r, cin_g)` order; `D_g`: the
      per-sample output gradients of group `g`'s channels, in the same rows.
    - `T`: the output positions per example; `rows = N · T`.

A depthwise convolution with depth multiplier `m` is the case
`groups = C_in`, `cin_g = 1`, `C_out = C_in · m`: Keras's `DepthwiseConv`
output channel `c · m + j` belongs to input channel `c`.
"""

import math

from keras import ops

from keras_thor.src.backend.patches import conv_patches


def grouped_conv_statistics(
    inputs,
    sample_output_grads,
    kernel_size,
    strides,
    dilation_rate,
    padding,
    groups,
    bias_row=False,
):
    """`(Σ M_gᵀM_g, Σ D_gᵀD_g, rows)` of a channels-last convolution.

    `inputs` `(N, *spatial, C_in)`, `sample_output_grads`
    `(N, *out_spatial, C_out)`. Returns `a_sums` `(groups, K·cin_g,
    K·cin_g)`, `g_sums` `(groups, cout_g, cout_g)` (float32) and `rows`, a
    float32 scalar (a tensor: dynamic when the shapes are). With
    `groups = 1` these are the Dense statistics of the patches. With
    `bias_row`, every group's patch rows end in a 1 (`K·cin_g + 1` wide).
    """
    patches = conv_patches(inputs, kernel_size, strides, dilation_rate, padding)
    patches = ops.reshape(ops.cast(patches, "float32"), (-1, patches.shape[-1]))
    grads = ops.cast(sample_output_grads, "float32")
    grads = ops.reshape(grads, (-1, grads.shape[-1]))
    rows = ops.cast(ops.shape(patches)[0], "float32")
    if groups == 1:
        if bias_row:
            ones = ops.ones_like(patches[:, :1])
            patches = ops.concatenate([patches, ones], axis=-1)
        a_sums = ops.matmul(ops.transpose(patches), patches)
        g_sums = ops.matmul(ops.transpose(grads), grads)
        return a_sums[None], g_sums[None], rows
    taps = math.prod(kernel_size)
    cin_g = _group_size(inputs.shape[-1], groups)
    cout_g = _group_size(grads.shape[-1], groups)
    patches = ops.reshape(patches, (-1, taps, groups, cin_g))
    # Group-major rows `(rows, groups, K·cin_g)`, as the kernel matrices.
    patches = ops.reshape(
        ops.transpose(patches, (0, 2, 1, 3)), (-1, groups, taps * cin_g)
    )
    if bias_row:
        ones = ops.ones_like(patches[:, :, :1])
        patches = ops.concatenate([patches, ones], axis=-1)
    a_sums = ops.einsum("rgk,rgl->gkl", patches, patches)
    grads = ops.reshape(grads, (-1, groups, cout_g))
    g_sums = ops.einsum("rgo,rgp->gop", grads, grads)
    return a_sums, g_sums, rows


def conv_factor_scale(sample_output_grads):
    """`√T`, `T` the output positions of a channels-last convolution.

    `T` is the product of the spatial dims of `(N, *out_spatial, C_out)`:
    a Python float when they are static, else a float32 tensor.
    """
    spatial = sample_output_grads.shape[1:-1]
    if all(size is not None for size in spatial):
        return math.sqrt(math.prod(spatial))
    positions = 1
    for size in ops.shape(sample_output_grads)[1:-1]:
        positions = positions * size
    return ops.sqrt(ops.cast(positions, "float32"))


def grouped_kernel_matrices(kernel, groups, depthwise=False):
    """A conv kernel as one `(K·cin_g, cout_g)` matrix `W_g` per group.

    A grouped kernel `(k_1, ..., k_r, cin_g, C_out)` gives
    `(groups, K·cin_g, cout_g)`, rows in `(k_1, ..., k_r, cin_g)` order, so
    that group `g`'s outputs are `M_g @ W_g`. With `depthwise=True` a
    depthwise kernel `(k_1, ..., k_r, C, m)` gives `(C, K, m)`
    (`groups` must be `C`).
    """
    shape = tuple(kernel.shape)
    taps = math.prod(shape[:-2])
    if depthwise:
        _check_depthwise(shape, groups)
        matrices = ops.reshape(kernel, (taps, shape[-2], shape[-1]))
        return ops.transpose(matrices, (1, 0, 2))
    cin_g, cout_g = shape[-2], _group_size(shape[-1], groups)
    matrices = ops.reshape(kernel, (taps, cin_g, groups, cout_g))
    matrices = ops.transpose(matrices, (2, 0, 1, 3))
    return ops.reshape(matrices, (groups, taps * cin_g, cout_g))


def kernel_from_grouped_matrices(
    matrices, kernel_shape, groups, depthwise=False
):
    """The inverse of `grouped_kernel_matrices`: a kernel of `kernel_shape`."""
    shape = tuple(kernel_shape)
    taps = math.prod(shape[:-2])
    if depthwise:
        _check_depthwise(shape, groups)
        return ops.reshape(ops.transpose(matrices, (1, 0, 2)), shape)
    cin_g, cout_g = shape[-2], _group_size(shape[-1], groups)
    matrices = ops.reshape(matrices, (groups, taps, cin_g, cout_g))
    return ops.reshape(ops.transpose(matrices, (1, 2, 0, 3)), shape)


def _check_depthwise(kernel_shape, groups):
    if kernel_shape[-2] != groups:
        raise ValueError(
            f"a depthwise kernel {kernel_shape} has {kernel_shape[-2]} "
            f"groups, got groups={groups}"
        )


def _group_size(channels, groups):
    if channels % groups:
        raise ValueError(f"groups={groups} does not divide {channels} channels")
    return channels // groups
