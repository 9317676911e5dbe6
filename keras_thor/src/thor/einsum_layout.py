"""`keras.layers.EinsumDense` as a Dense layer on rows, for THOR.

An equation `"in,kernel->out"` is a Kronecker-factorable dense map when
every letter is of one of three kinds:

Notation:
    - batch letters `b`: in the input and the output, not the kernel;
    - contracted letters `c`: in the input and the kernel, not the output;
    - free letters `f`: in the kernel and the output, not the input.

Then `y[b, f] = Σ_c x[b, c] · W[c, f]`: with `X` the input as rows
`(R, d_in)` (batch letters in input order, then contracted letters in kernel
order), `Y` the output as rows `(R, d_out)` (the same batch order, then free
letters in kernel order) and `W` the kernel as a `(d_in, d_out)` matrix
(contracted, then free letters, in kernel order), `Y = X @ W` and
`dL/dW = Xᵀ @ dL/dY`, so `A = XᵀX / R`, `G = DᵀD / R` as for Dense.
`d_in` (`d_out`) is the product of the contracted (free) dims of the kernel.
"""

import math
import string

from keras import ops


def static_product(sizes):
    """The product of `sizes`, None if one is unknown."""
    if any(size is None for size in sizes):
        return None
    return math.prod(sizes)


class UnsupportedEinsumError(ValueError):
    """An EinsumDense equation that is not a dense map on rows."""


class EinsumLayout:
    """Row layouts of an EinsumDense equation; see the module docstring.

    Attributes:
        equation: the equation, with `...` expanded to fresh letters.
        batch, contracted, free: the letters of each kind, in row order.
    """

    def __init__(self, inputs, kernel, outputs):
        self.equation = f"{inputs},{kernel}->{outputs}"
        self._inputs, self._kernel, self._outputs = inputs, kernel, outputs
        self.batch = "".join(a for a in inputs if a not in kernel)
        self.contracted = "".join(a for a in kernel if a in inputs)
        self.free = "".join(a for a in kernel if a in outputs)
        self._input_order = _permutation(inputs, self.batch + self.contracted)
        self._output_order = _permutation(outputs, self.batch + self.free)
        self._kernel_order = _permutation(kernel, self.contracted + self.free)

    def dims(self, kernel_shape):
        """`(d_in, d_out)`: the contracted and free sizes of a kernel."""
        sizes = dict(zip(self._kernel, kernel_shape))
        return (
            math.prod(sizes[a] for a in self.contracted),
            math.prod(sizes[a] for a in self.free),
        )

    def rows_per_example(self, output_shape):
        """The rows one example gives: the product of the batch letters'
        sizes after the first (the examples'), None if one is unknown."""
        sizes = dict(zip(self._outputs, output_shape))
        return static_product([sizes[a] for a in self.batch[1:]])

    def input_rows(self, inputs):
        """`X` `(R, d_in)`: batch letters, then contracted ones."""
        return _rows(inputs, self._input_order, len(self.contracted))

    def output_rows(self, outputs):
        """`Y` (or `dL/dY`) `(R, d_out)`: batch letters, then free ones."""
        return _rows(outputs, self._output_order, len(self.free))

    def kernel_matrix(self, kernel):
        """`W` `(d_in, d_out)`: contracted letters, then free ones."""
        d_in, d_out = self.dims(kernel.shape)
        kernel = ops.transpose(kernel, self._kernel_order)
        return ops.reshape(kernel, (d_in, d_out))

    def kernel_from_matrix(self, matrix, kernel_shape):
        """The inverse of `kernel_matrix`: a kernel of `kernel_shape`."""
        order = self._kernel_order
        permuted = tuple(kernel_shape[axis] for axis in order)
        kernel = ops.reshape(matrix, permuted)
        return ops.transpose(kernel, _inverse(order))


def einsum_layout(equation, input_rank):
    """The `EinsumLayout` of `equation` for inputs of rank `input_rank`.

    `...` may stand for leading or trailing input axes (the same ones in
    the output); it is expanded with fresh letters. Raises
    `UnsupportedEinsumError` with the reason when the equation is not a
    dense map on rows (see `unsupported_reason`).
    """
    inputs, kernel, outputs = _parse(equation.replace(" ", ""), input_rank)
    reason = _kind_error(inputs, kernel, outputs)
    if reason is not None:
        raise UnsupportedEinsumError(f"EinsumDense {equation!r}: {reason}")
    return EinsumLayout(inputs, kernel, outputs)


def unsupported_reason(equation, input_rank):
    """`None` when `einsum_layout` supports `equation`, else why not."""
    try:
        einsum_layout(equation, input_rank)
    except UnsupportedEinsumError as error:
        return str(error)
    return None


def _parse(equation, input_rank):
    """`(inputs, kernel, outputs)` letters, `...` expanded."""
    operands, arrow, outputs = equation.partition("->")
    inputs, comma, kernel = operands.partition(",")
    if not arrow or not comma or "," in kernel or "->" in outputs:
        raise UnsupportedEinsumError(
            f"EinsumDense {equation!r}: expected 'input,kernel->output'"
        )
    for part in (inputs, kernel, outputs):
        if not set(part.replace("...", "")) <= set(string.ascii_letters):
            raise UnsupportedEinsumError(
                f"EinsumDense {equation!r}: letters and '...' only"
            )
        if len(set(part.replace("...", ""))) != len(part.replace("...", "")):
            raise UnsupportedEinsumError(
                f"EinsumDense {equation!r}: a letter repeats in {part!r} "
                "(a diagonal or trace)"
            )
    if "..." in kernel:
        raise UnsupportedEinsumError(
            f"EinsumDense {equation!r}: '...' in the kernel"
        )
    if ("..." in inputs) != ("..." in outputs) or inputs.count("...") > 1:
        raise UnsupportedEinsumError(
            f"EinsumDense {equation!r}: '...' must appear once in the input "
            "and once in the output"
        )
    if "..." in inputs:
        elided = input_rank - len(inputs.replace("...", ""))
        if elided < 0:
            raise UnsupportedEinsumError(
                f"EinsumDense {equation!r}: inputs of rank {input_rank} "
                "have too few axes"
            )
        used = set(equation)
        fresh = "".join(a for a in string.ascii_letters if a not in used)
        inputs = inputs.replace("...", fresh[:elided])
        outputs = outputs.replace("...", fresh[:elided])
    if len(inputs) != input_rank:
        raise UnsupportedEinsumError(
            f"EinsumDense {equation!r}: inputs of rank {input_rank} for "
            f"{len(inputs)} input letters"
        )
    return inputs, kernel, outputs


def _kind_error(inputs, kernel, outputs):
    """Why some letter is not a batch, contracted or free one, or `None`."""
    for letter in dict.fromkeys(inputs + kernel + outputs):
        where = (letter in inputs, letter in kernel, letter in outputs)
        if where == (True, True, True):
            return (
                f"{letter!r} is in the input, kernel and output (a kernel "
                "shared along a batch axis is not one dense map)"
            )
        if where == (False, True, False):
            return f"{letter!r} is only in the kernel (the kernel is summed)"
        if where == (True, False, False):
            return f"{letter!r} is only in the input (the input is summed)"
        if where == (False, False, True):
            return f"{letter!r} is only in the output (a broadcast axis)"
    return None


def _permutation(letters, order):
    return tuple(letters.index(a) for a in order)


def _inverse(permutation):
    inverse = [0] * len(permutation)
    for position, axis in enumerate(permutation):
        inverse[axis] = position
    return tuple(inverse)


def _rows(tensor, order, trailing):
    """`tensor` transposed to `order`, then as rows of its `trailing` axes."""
    tensor = ops.transpose(tensor, order)
    static = tensor.shape[len(order) - trailing :]
    if all(size is not None for size in static):
        width = math.prod(static)
    else:
        width = 1
        for size in ops.shape(tensor)[len(order) - trailing :]:
            width = width * size
    return ops.reshape(tensor, (-1, width))
