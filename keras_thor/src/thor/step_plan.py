"""What THOR's training step needs to know, fixed when THOR is built."""

import dataclasses
from collections.abc import Callable

from keras_thor.src import keras_internals
from keras_thor.src.thor.preconditioning import factored_is_cheaper


def takes_factored_order(block, batch_size, keras_clipping):
    """Whether `block`'s kernel is preconditioned in the factored order.

    Only for Dense kernels where it costs fewer flops for the rows a call
    is expected to have (`batch_size` times the other leading dimensions
    the layer was built for), and never with Keras's clipping options
    (`keras_clipping`, which would then clip a preconditioned gradient).
    """
    if not block.factored or keras_clipping:
        return False
    shape = keras_internals.built_input_shape(block.layer)
    rows = batch_size
    for dimension in (shape or (None, None))[1:-1]:
        if dimension is None:
            return False
        rows *= dimension
    return factored_is_cheaper(block.a_dim, block.g_dim, rows)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """THOR's training step, as decided once when THOR is built.

    The step records the calls of every block (`CurvatureEstimator`) on
    statistics steps and of the `factored_kernels` on every step; its
    direction stage (`directions`) forms the directions of
    `preconditioned_in_step`, which the update then takes as they are.

    Args:
        factored_kernels: The variable indices preconditioned in the
            factored order (Dense kernels where that is cheaper).
        guarded_kernels: The variable indices whose directions the KL
            guard scales: every block with `kl_clip`, else none.
        fisher: `"empirical"` or `"sampled"`: the loss whose output
            gradients give the statistics.
        variable_index: `variable -> index` in THOR's trained variables
            (`None` for a variable THOR does not train).
        joint_biases: `{kernel index: bias index}` of the blocks that
            precondition a kernel and its bias together (`joint_bias`).
    """

    factored_kernels: frozenset
    guarded_kernels: frozenset
    fisher: str
    variable_index: Callable
    joint_biases: dict = dataclasses.field(default_factory=dict)

    @property
    def preconditioned_in_step(self):
        """The variable indices whose gradient the step preconditions."""
        joint = set(self.joint_biases) | set(self.joint_biases.values())
        return self.factored_kernels | self.guarded_kernels | joint

    @classmethod
    def for_blocks(cls, blocks, variable_index, options, batch_size, clipping):
        """The plan for THOR's `blocks` under its `CurvatureOptions`:
        with `kl_clip` every block is guarded and none factored, else the
        Dense kernels `takes_factored_order` picks (none with Keras's
        `clipping`) are factored."""
        guarded = options.kl_clip is not None
        return cls(
            factored_kernels=frozenset(
                index
                for index, block in blocks.items()
                if not guarded
                and takes_factored_order(block, batch_size, clipping)
            ),
            guarded_kernels=frozenset(blocks if guarded else ()),
            fisher=options.fisher,
            variable_index=variable_index,
            joint_biases={
                index: variable_index(block.bias)
                for index, block in blocks.items()
                if getattr(block, "bias", None) is not None
            },
        )
