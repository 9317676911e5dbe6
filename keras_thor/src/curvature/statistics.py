"""Curvature statistics of one layer call: the sums behind THOR's A and G.

Each function returns sums over rows (`XᵀX`, `DᵀD`) and the row count, so
replicas can add theirs up before anything is divided: the mean over the
global batch is then exact even when replicas see different batch sizes.

Notation:
    - `X`: the layer's inputs as rows (one row per example, sequence
      position or conv output position); `D`: the per-sample gradients of
      the loss with respect to the layer's outputs, in the same rows
      (the gradient of the mean loss times the number of examples `N`).
    - `A = XᵀX / rows`, `G = DᵀD / rows`: THOR's factors.
"""

import math

from keras import ops

from keras_thor.src.backend.patches import image_patches


def _rows(tensor):
    return ops.reshape(ops.cast(tensor, "float32"), (-1, tensor.shape[-1]))


def _gram(rows):
    return ops.matmul(ops.transpose(rows), rows)


def _row_count(rows):
    return ops.cast(ops.shape(rows)[0], "float32")


def dense_statistics(inputs, sample_output_grads):
    """`(XᵀX, DᵀD, rows)` of a Dense layer on inputs of any rank."""
    inputs, grads = _rows(inputs), _rows(sample_output_grads)
    return _gram(inputs), _gram(grads), _row_count(inputs)


def conv2d_statistics(
    inputs, sample_output_grads, kernel_size, strides, dilation_rate, padding
):
    """`(MᵀM, DᵀD, rows)` of a channels-last 2-D convolution.

    `M` holds one im2col patch per (example, output position); a row of `D`
    is the output gradient at that position.
    """
    patches = _rows(
        image_patches(inputs, kernel_size, strides, dilation_rate, padding)
    )
    grads = _rows(sample_output_grads)
    return _gram(patches), _gram(grads), _row_count(patches)


def conv2d_factor_scale(sample_output_grads):
    """`√T`, `T` the output positions of a channels-last convolution.

    A Python float when the spatial size is static, else a tensor.
    """
    height, width = sample_output_grads.shape[1:3]
    if height is not None and width is not None:
        return math.sqrt(height * width)
    shape = ops.shape(sample_output_grads)
    return ops.sqrt(ops.cast(shape[1] * shape[2], "float32"))


def embedding_statistics(ids, sample_output_grads, vocabulary_size):
    """`(counts, DᵀD, rows)` of an Embedding lookup.

    An embedding is a bias-free Dense layer on one-hot ids, so `XᵀX` is the
    diagonal of token counts; only that diagonal is kept.
    """
    ids = ops.reshape(ops.cast(ids, "int32"), (-1,))
    counts = ops.segment_sum(
        ops.ones_like(ids, dtype="float32"),
        ids,
        num_segments=vocabulary_size,
    )
    grads = _rows(sample_output_grads)
    return counts, _gram(grads), _row_count(grads)
