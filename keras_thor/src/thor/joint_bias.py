"""A kernel and its bias as one Kronecker block on `[x, 1]` rows (opt-in:
`THOR(precondition_biases="joint")`), as every K-FAC peer does.

```
A = [X, 1]ᵀ[X, 1] / rows            (a_dim + 1 wide; per group)
[d_W; d_b] = A⁻¹ · [g_W; g_b] · G⁻¹
```

Notation:
    - `X`: the kernel block's input rows (a Dense layer's inputs, a
      convolution's im2col patches: the 1 ends every patch row, so the
      bias is the homogeneous coordinate of each output position and
      shares the block's `√T` scale).
    - `g_W`, `g_b`: the kernel's gradient as the block's matrices and the
      bias's as one more row; `G`: the kernel block's.

The direction of both variables comes from the training step's direction
stage (`directions`; the update takes it as it is), from each replica's
gradient: preconditioning is linear, and the inverses are the same on
every replica.
"""

from keras import ops

from keras_thor.src.thor.blocks import ConvKronecker
from keras_thor.src.thor.blocks import DenseKronecker
from keras_thor.src.thor.blocks import KroneckerBlock
from keras_thor.src.thor.preconditioning import kronecker_precondition

JOINABLE = (DenseKronecker, ConvKronecker)


class JointBiasKronecker(KroneckerBlock):
    """`kernel_block`'s factors with the bias row and column.

    Attributes:
        inner: The kernel's own block (what the layer's calls record).
        bias: The bias variable, preconditioned with the kernel.
    """

    def __init__(self, kernel_block, bias):
        self.inner = kernel_block
        self.bias = bias
        super().__init__(
            kernel_block.layer,
            kernel_block.kernel,
            kernel_block.groups,
            kernel_block.a_dim + 1,
            kernel_block.g_dim,
        )

    @property
    def recorded_block(self):
        return self.inner

    def a_split_dim(self, split_dim):
        """`split_dim + 1`: the bias row never opens a block of its own
        (a 256-input Dense at `split_dim=256` keeps one 257-wide block)."""
        return split_dim + 1

    def statistics(self, inputs, sample_output_grads):
        return self.inner.statistics(inputs, sample_output_grads, bias_row=True)

    def rows_per_example(self, sample_output_grads):
        return self.inner.rows_per_example(sample_output_grads)

    def precondition_pair(self, kernel_grad, bias_grad, a_inverse, g_inverse):
        """`(d_W, d_b)` from the kernel's and the bias's gradients."""
        kernel_rows = self.inner.to_matrices(
            ops.reshape(ops.cast(kernel_grad, "float32"), self.kernel.shape)
        )
        bias_row = ops.reshape(
            ops.cast(bias_grad, "float32"), (self.groups, 1, self.g_dim)
        )
        matrices = ops.concatenate([kernel_rows, bias_row], axis=1)
        product = kronecker_precondition(matrices, a_inverse, g_inverse)
        return (
            self.inner.from_matrices(product[:, :-1]),
            ops.reshape(product[:, -1], self.bias.shape),
        )
