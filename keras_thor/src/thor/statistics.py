"""Curvature statistics of one Dense or Embedding call: THOR's A and G sums.

Each function returns sums over rows (`XᵀX`, `DᵀD`) and the row count, so
replicas can add theirs up before anything is divided: the mean over the
global batch is then exact even when replicas see different batch sizes.

Notation:
    - `X`: the layer's inputs as rows (one row per example, sequence
      position); `D`: the per-sample gradients of
      the loss with respect to the layer's outputs, in the same rows
      (the gradient of the mean loss times the number of loss terms:
      examples, times positions for a per-position loss; `loss_terms`).
    - `A = XᵀX / rows`, `G = DᵀD / rows`: THOR's factors.
"""

from keras import ops


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
