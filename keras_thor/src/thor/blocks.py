"""Curvature blocks: one kernel's Kronecker-factored curvature, per layer kind.

As in kfac-jax's `curvature_blocks`, a block owns what is particular to a
kind of layer: the shapes of its factors and stored inverses, its
statistics from a recorded call (inputs and per-sample output gradients),
how its kernel reads as the matrices the factors act on, and its
preconditioning, in the direct order `A⁻¹ · g · G⁻¹` and (Dense) the
factored order `(A⁻¹Xᵀ)(D·G⁻¹)`. Damping and inversion are shared
(`damping_split`, `factor_inverses`, from `factor_blocks`); the schedule
and the state live in the `CurvatureEstimator`.

Notation:
    - `X`: a call's inputs as rows; `D`: the per-sample gradients of the
      loss at its pre-activation outputs, in the same rows.
    - `A_j = X_jᵀX_j / rows`, `G_j = D_jᵀD_j / rows` for each group `j`
      (one group, except grouped and depthwise convolutions).
    - `c`: the factor scale, `√T` for a convolution with `T` output
      positions, else 1.
"""

import math

from keras import ops

from keras_thor.src.thor.block_inverse import block_layout
from keras_thor.src.thor.block_inverse import diagonal_blocks
from keras_thor.src.thor.conv_statistics import conv_factor_scale
from keras_thor.src.thor.conv_statistics import grouped_conv_statistics
from keras_thor.src.thor.conv_statistics import grouped_kernel_matrices
from keras_thor.src.thor.conv_statistics import kernel_from_grouped_matrices
from keras_thor.src.thor.einsum_layout import static_product
from keras_thor.src.thor.preconditioning import diagonal_kronecker_precondition
from keras_thor.src.thor.preconditioning import factored_precondition
from keras_thor.src.thor.preconditioning import kronecker_precondition
from keras_thor.src.thor.preconditioning import layer_norm_precondition
from keras_thor.src.thor.statistics import dense_statistics
from keras_thor.src.thor.statistics import embedding_statistics


def _positions(shape, data_format="channels_last"):
    """The sizes of the output positions: the axes between the batch and
    the features."""
    return shape[2:] if data_format == "channels_first" else shape[1:-1]


def _channels_last(tensor, data_format):
    if data_format == "channels_first":
        rank = len(tensor.shape)
        return ops.transpose(tensor, (0, *range(2, rank), 1))
    return tensor


class KroneckerBlock:
    """A kernel preconditioned by Kronecker factors `A_j ⊗ G_j`.

    Subclasses give `statistics(inputs, sample_output_grads)`: the sums
    `(A sums, G sums, rows, c)` of one recorded call.

    Attributes:
        layer: The Keras layer the kernel belongs to.
        kernel: The variable THOR preconditions.
        groups, a_dim, g_dim: `groups` factor pairs of sizes `a_dim` and
            `g_dim`; the kernel reads as `(groups, a_dim, g_dim)`.
        a_is_diagonal: Whether `A` is kept as its diagonal (Embedding).
        factored: Whether the factored order exists for this block.
        convolutional: Whether its statistics take one row per output
            position of each example (`conv_statistics_rows`).
        rows_are_examples: Whether its statistics take one row per example
            (whose count of loss terms they then need:
            `statistics(..., terms_per_example)`).
    """

    a_is_diagonal = False
    factored = False
    convolutional = False
    rows_are_examples = False

    def __init__(self, layer, kernel, groups, a_dim, g_dim):
        self.layer = layer
        self.kernel = kernel
        self.groups = groups
        self.a_dim = a_dim
        self.g_dim = g_dim

    def rows_per_example(self, sample_output_grads):
        """The statistics' rows one example gives (its output positions:
        the axes between the batch and the features), None if a size is
        unknown when traced."""
        return static_product(_positions(sample_output_grads.shape))

    def examples_for_width(self, sample_output_grads):
        """The fewest examples whose rows reach the widest full factor,
        `⌈max(a_dim, g_dim) / rows per example⌉` (a diagonal `A` does not
        count: `g_dim` alone) (`statistics_rows="width"`); None (the whole
        batch) if the rows per example are unknown."""
        rows = self.rows_per_example(sample_output_grads)
        if rows is None:
            return None
        width = (
            self.g_dim if self.a_is_diagonal else max(self.a_dim, self.g_dim)
        )
        return max(1, math.ceil(width / rows))

    def a_split_dim(self, split_dim):
        """The block size `A` is cut at: `split_dim` (a joint bias block's
        `[x, 1]` row does not count toward it)."""
        return split_dim

    def inverse_shapes(self, split_dim):
        """The shapes of the stored `A⁻¹` and `G⁻¹`."""
        if self.a_is_diagonal:
            a_shape = (self.a_dim,)
        else:
            blocks, size = block_layout(self.a_dim, self.a_split_dim(split_dim))
            a_shape = (self.groups * blocks, size, size)
        blocks, size = block_layout(self.g_dim, split_dim)
        return a_shape, (self.groups * blocks, size, size)

    @property
    def recorded_block(self):
        """The block whose layer calls the training step records."""
        return self

    def to_matrices(self, gradient):
        """A kernel-shaped tensor as `(groups, a_dim, g_dim)`."""
        return ops.reshape(gradient, (1, self.a_dim, self.g_dim))

    def from_matrices(self, matrices):
        """The inverse of `to_matrices`."""
        return ops.reshape(matrices, self.kernel.shape)

    def factor_blocks(self, statistics, split_dim):
        """`(c·A_j, c·G_j)` from averaged `(A, G, c)`, cut into the blocks
        the inverses are made of (a diagonal `A` stays a vector)."""
        a, g, factor_scale = statistics
        a = ops.cast(a, "float32")
        g = ops.cast(g, "float32")
        if not self.a_is_diagonal:
            a = diagonal_blocks(factor_scale * a, self.a_split_dim(split_dim))
        return a, diagonal_blocks(factor_scale * g, split_dim)

    @property
    def factor_layouts(self):
        """`((groups, a_dim), (groups, g_dim))`: the sizes `factor_blocks`
        cut and pad."""
        return (self.groups, self.a_dim), (self.groups, self.g_dim)

    def precondition(self, gradient, a_inverse, g_inverse, damping, batch_size):
        """`A⁻¹ · g · G⁻¹`, group by group, in the kernel's shape."""
        matrices = self.to_matrices(gradient)
        return self.from_matrices(
            kronecker_precondition(matrices, a_inverse, g_inverse)
        )

    def factor_means(self, a_sum, g_sum, rows):
        """`(A, G)` from the statistics of the step's calls, summed over
        the calls (and replicas): the means over their rows."""
        return a_sum / rows, g_sum / rows


class DenseKronecker(KroneckerBlock):
    """`keras.layers.Dense`: `A = XᵀX / rows`, `G = DᵀD / rows`.

    All leading axes of the inputs are rows (examples, sequence
    positions). The only block with the factored order.
    """

    factored = True

    def __init__(self, layer, kernel):
        d_in, d_out = kernel.shape
        super().__init__(layer, kernel, 1, d_in, d_out)

    def statistics(self, inputs, sample_output_grads, bias_row=False):
        if bias_row:  # `[x, 1]` (`joint_bias`).
            inputs = ops.cast(inputs, "float32")
            ones = ops.ones_like(inputs[..., :1])
            inputs = ops.concatenate([inputs, ones], axis=-1)
        a_sum, g_sum, rows = dense_statistics(inputs, sample_output_grads)
        return a_sum[None], g_sum[None], rows, 1.0

    def factored_gradient(self, inputs, output_grads, a_inverse, g_inverse):
        """`(A⁻¹Xᵀ)(D·G⁻¹)`: `A⁻¹ · g · G⁻¹` of one call without `g`."""
        rows = ops.reshape(ops.cast(inputs, "float32"), (-1, self.a_dim))
        grads = ops.reshape(ops.cast(output_grads, "float32"), (-1, self.g_dim))
        return factored_precondition(rows, grads, a_inverse, g_inverse)


class EinsumDenseKronecker(KroneckerBlock):
    """`keras.layers.EinsumDense` (MultiHeadAttention's projections).

    The equation's kernel axes are contracted input axes or free output
    axes; the kernel reads as the matrix `(contracted, free)` and the
    layer is a Dense layer on rows of the remaining (batch) axes.
    """

    def __init__(self, layer, kernel, layout):
        self.layout = layout
        super().__init__(layer, kernel, 1, *layout.dims(kernel.shape))

    def statistics(self, inputs, sample_output_grads):
        a_sum, g_sum, rows = dense_statistics(
            self.layout.input_rows(inputs),
            self.layout.output_rows(sample_output_grads),
        )
        return a_sum[None], g_sum[None], rows, 1.0

    def rows_per_example(self, sample_output_grads):
        return self.layout.rows_per_example(sample_output_grads.shape)

    def to_matrices(self, gradient):
        return self.layout.kernel_matrix(gradient)[None]

    def from_matrices(self, matrices):
        return self.layout.kernel_from_matrix(matrices[0], self.kernel.shape)


class ExpertsKronecker(KroneckerBlock):
    """Batched expert kernels `(E, in, out)`, one Dense layer per expert
    (keras-hub's `MixtralMoeExperts`): `A_e ⊗ G_e` for each expert `e`.

    The experts run on every token and the router weights their outputs
    afterwards, so the rows are the tokens, and an expert's output
    gradients are zero at the tokens not routed to it. The inputs are
    `(T, in)`, shared by the experts (the gate and up projections), or
    `(E, T, in)`, each expert's own (the down projection); the output
    gradients are `(E, T, out)`.
    """

    def __init__(self, layer, kernel):
        experts, d_in, d_out = kernel.shape
        super().__init__(layer, kernel, experts, d_in, d_out)

    def statistics(self, inputs, sample_output_grads):
        inputs = ops.cast(inputs, "float32")
        grads = ops.cast(sample_output_grads, "float32")
        if len(inputs.shape) == 2:
            shared = ops.matmul(ops.transpose(inputs), inputs)
            a_sums = ops.broadcast_to(
                shared[None], (self.groups, self.a_dim, self.a_dim)
            )
        else:
            a_sums = ops.einsum("eti,etj->eij", inputs, inputs)
        g_sums = ops.einsum("eti,etj->eij", grads, grads)
        return a_sums, g_sums, ops.cast(ops.shape(grads)[1], "float32"), 1.0

    def rows_per_example(self, sample_output_grads):
        # The tokens of all examples, flattened by the MoE block.
        return None

    def to_matrices(self, gradient):
        return ops.reshape(gradient, (self.groups, self.a_dim, self.g_dim))


class ConvKronecker(KroneckerBlock):
    """A 1-, 2- or 3-D convolution, grouped or depthwise.

    `A_j` from the im2col patches of group `j`'s input channels (the
    layer's own padding, strides and dilation), `G_j` from its output
    channels' gradients, one row per (example, output position), and
    MindSpore's `√T` split: `(√T·A_j + √λ·I)⁻¹`, `(√T·G_j + √λ·I)⁻¹`.
    A depthwise convolution is the grouped one with a group per input
    channel.
    """

    convolutional = True

    def __init__(self, layer, kernel, options, groups, depthwise):
        self.options = options
        self.depthwise = depthwise
        *window, channels, outputs = kernel.shape
        positions = 1
        for size in window:
            positions *= size
        if depthwise:  # (k.., C, m): a group per input channel.
            a_dim, g_dim = positions, outputs
        else:  # (k.., C_in / groups, C_out).
            a_dim, g_dim = positions * channels, outputs // groups
        super().__init__(layer, kernel, groups, a_dim, g_dim)

    def statistics(self, inputs, sample_output_grads, bias_row=False):
        data_format = self.options["data_format"]
        inputs = _channels_last(inputs, data_format)
        grads = _channels_last(sample_output_grads, data_format)
        a_sums, g_sums, rows = grouped_conv_statistics(
            inputs,
            grads,
            self.options["kernel_size"],
            self.options["strides"],
            self.options["dilation_rate"],
            self.options["padding"],
            self.groups,
            bias_row,
        )
        return a_sums, g_sums, rows, conv_factor_scale(grads)

    def rows_per_example(self, sample_output_grads):
        return static_product(
            _positions(sample_output_grads.shape, self.options["data_format"])
        )

    def to_matrices(self, gradient):
        return grouped_kernel_matrices(gradient, self.groups, self.depthwise)

    def from_matrices(self, matrices):
        return kernel_from_grouped_matrices(
            matrices, self.kernel.shape, self.groups, self.depthwise
        )


class EmbeddingKronecker(KroneckerBlock):
    """`keras.layers.Embedding`: the Dense rule on one-hot ids, whose `A`
    is the diagonal of token counts: `diag(1 / (a + √λ)) · g · G⁻¹`."""

    a_is_diagonal = True

    def __init__(self, layer, kernel):
        vocabulary, width = kernel.shape
        super().__init__(layer, kernel, 1, vocabulary, width)

    def statistics(self, inputs, sample_output_grads):
        counts, g_sum, rows = embedding_statistics(
            inputs, sample_output_grads, self.a_dim
        )
        return counts, g_sum[None], rows, 1.0

    def precondition(self, gradient, a_inverse, g_inverse, damping, batch_size):
        return diagonal_kronecker_precondition(gradient, a_inverse, g_inverse)


class TiedEmbeddingKronecker(KroneckerBlock):
    """`keras.layers.ReversibleEmbedding(tie_weights=True)`: one table `E`
    `(V, W)` used twice, as the lookup (an Embedding: the diagonal `a` of
    token counts on the vocabulary side, `G_lookup` on the width side) and
    as the head `x · Eᵀ` (a Dense layer on `Eᵀ`: `A_head` on the width
    side, `G_head` on the vocabulary side). The table's Fisher is the sum
    of its uses'; the block takes the Kronecker product of the summed
    factors, each use's the mean over its own rows:

    ```
    L = diag(a) + G_head        (V × V)
    R = G_lookup + A_head       (W × W)
    d = L⁻¹ · g · R⁻¹           (damped as any block's A and G)
    ```

    The product adds the cross terms `diag(a) ⊗ A_head` and
    `G_head ⊗ G_lookup` to the uses' own Fishers. A call with integer
    inputs is the lookup, any other the head. The statistics keep the two
    uses apart (a leading axis of 2, rows per use) until `factor_means`;
    a use the step did not record adds nothing.
    """

    def __init__(self, layer, table):
        vocabulary, width = table.shape
        super().__init__(layer, table, 1, vocabulary, width)

    def statistics(self, inputs, sample_output_grads):
        if "int" in str(inputs.dtype):
            counts, g_sum, rows = embedding_statistics(
                inputs, sample_output_grads, self.a_dim
            )
            left, right, use = ops.diag(counts), g_sum, 0
        else:
            right, left, rows = dense_statistics(inputs, sample_output_grads)
            use = 1
        slots = [1.0 if i == use else 0.0 for i in range(2)]
        weights = ops.convert_to_tensor(slots, "float32")
        return (
            weights[:, None, None] * left[None],
            weights[:, None, None] * right[None],
            weights * rows,
            1.0,
        )

    def factor_means(self, a_sum, g_sum, rows):
        per_use = ops.maximum(rows, 1.0)[:, None, None]
        return (
            ops.sum(a_sum / per_use, axis=0, keepdims=True),
            ops.sum(g_sum / per_use, axis=0, keepdims=True),
        )


class BiasKronecker(KroneckerBlock):
    """A layer's bias as K-FAC's homogeneous input coordinate (opt-in:
    `THOR(precondition_biases=...)`): `A = 1`, `G_b = SᵀS / M`, so the
    step is `(1 + √λ)⁻¹ · g · (G_b + √λ·I)⁻¹`.

    `S` `(N, units)` holds each example's output-gradient rows `D` summed
    over the positions the bias is shared by (sequence positions, a
    convolution's output pixels, the axes an EinsumDense bias is broadcast
    over): the per-example bias gradients of the example's loss terms
    summed. Summing before the outer product (K-FAC-reduce's `G`) keeps
    what a per-row average loses: a bias added at every position moves all
    of them together. `M = N·L` counts the loss terms (`L` an example, 1
    for a per-example loss): the sum of an example's `L` terms has `L`
    times a term's second moment when its terms are uncorrelated, so `/M`
    is the per-term Fisher every other block estimates.

    Attributes:
        shared: Whether the bias is added at several positions of each
            example (what `precondition_biases="shared"` selects).
    """

    a_is_diagonal = True
    rows_are_examples = True

    def __init__(self, layer, bias, data_format, shared):
        self.data_format = data_format
        self.shared = shared
        super().__init__(layer, bias, 1, 1, math.prod(bias.shape))

    def statistics(self, inputs, sample_output_grads, terms_per_example=1):
        grads = _channels_last(
            ops.cast(sample_output_grads, "float32"), self.data_format
        )
        rank = len(grads.shape) - 1
        bias_shape = (1,) * (rank - len(self.kernel.shape)) + tuple(
            self.kernel.shape
        )
        shared = [1 + i for i, size in enumerate(bias_shape) if size == 1]
        sums = ops.sum(grads, axis=shared) if shared else grads
        sums = ops.reshape(sums, (-1, self.g_dim))
        terms = ops.cast(ops.shape(sums)[0] * terms_per_example, "float32")
        return (
            ops.reshape(terms, (1,)),
            ops.matmul(ops.transpose(sums), sums)[None],
            terms,
            1.0,
        )

    def rows_per_example(self, sample_output_grads):
        return 1

    def to_matrices(self, gradient):
        return ops.reshape(gradient, (1, 1, self.g_dim))

    def precondition(self, gradient, a_inverse, g_inverse, damping, batch_size):
        matrix = ops.reshape(gradient, (1, self.g_dim))
        return ops.reshape(
            diagonal_kronecker_precondition(matrix, a_inverse, g_inverse),
            self.kernel.shape,
        )


class NormalizationDiagonal:
    """MindSpore's LayerNorm rule `g / (g² / N + √λ)`, every step, no state.

    For the scale and offset of LayerNormalization.
    """

    def __init__(self, layer):
        self.layer = layer

    def precondition(self, gradient, a_inverse, g_inverse, damping, batch_size):
        return layer_norm_precondition(gradient, damping, batch_size)
