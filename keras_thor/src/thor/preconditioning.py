"""THOR's preconditioners: Kronecker-factored and diagonal.

Notation:
    - `g`: a gradient (of the mean loss, unscaled); `w`: its variable.
    - `A⁻¹`, `G⁻¹`: the stored block-diagonal inverses of the damped input
      and output-gradient factors of the variable's layer.
    - `a⁻¹`: the inverse of a diagonal input factor (Embedding).
    - `λ`: the damping of the current step; `N`: THOR's `batch_size`.
"""

from keras import ops

from keras_thor.src.thor.block_inverse import multiply_left
from keras_thor.src.thor.block_inverse import multiply_right


def kronecker_precondition(matrices, a_inverse, g_inverse):
    """`A_j⁻¹ · g_j · G_j⁻¹` for each group's kernel gradient matrix.

    `matrices` is `(groups, d_in, d_out)`: a kernel gradient read as its
    layer's matrices (a Conv2D kernel `(kh, kw, C_in, C_out)` as one
    `(kh·kw·C_in, C_out)`, its im2col layout).
    """
    return multiply_right(multiply_left(a_inverse, matrices), g_inverse)


def factored_precondition(input_rows, output_grad_rows, a_inverse, g_inverse):
    """`(A⁻¹ · Xᵀ) · (D · G⁻¹)`: `A⁻¹ · g · G⁻¹` without forming `g = XᵀD`.

    `input_rows` `(R, d_in)` and `output_grad_rows` `(R, d_out)` are a Dense
    layer's inputs and the gradients of the loss at its pre-activation.
    """
    left = multiply_left(a_inverse, ops.transpose(input_rows)[None])
    right = multiply_right(output_grad_rows[None], g_inverse)
    return ops.matmul(left, right)[0]


def factored_is_cheaper(d_in, d_out, rows):
    """Whether the factored product costs fewer flops than the direct one.

    Direct `A⁻¹ · g · G⁻¹`: `d_in·d_out·(d_in + d_out)`; factored
    `(A⁻¹Xᵀ)(D·G⁻¹)`: `rows·(d_in² + d_out² + d_in·d_out)`, which also
    replaces the backward pass's `XᵀD`.
    """
    return rows * (d_in**2 + d_out**2 + d_in * d_out) < d_in * d_out * (
        d_in + d_out
    )


def diagonal_kronecker_precondition(gradient, a_inverse, g_inverse):
    """`diag(a⁻¹) · g · G⁻¹` for an Embedding table gradient `(V, E)`."""
    return multiply_right(a_inverse[None, :, None] * gradient[None], g_inverse)[
        0
    ]


def layer_norm_precondition(gradient, damping, batch_size):
    """`g / (g² / N + √λ)`: MindSpore's diagonal rule for LayerNorm (and,
    here, for the scale and offset of other normalization layers)."""
    return gradient / (ops.square(gradient) / batch_size + ops.sqrt(damping))


def plain_direction(
    preconditioner, gradient, a_inverse, g_inverse, damping, batch_size
):
    """The gradient after the variable's preconditioner (`None`: none)."""
    if preconditioner is None:
        return gradient
    return preconditioner.precondition(
        gradient, a_inverse, g_inverse, damping, batch_size
    )
