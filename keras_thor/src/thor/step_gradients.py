"""What a THOR training step's backward pass must give, on any backend.

The forward pass and the gradient call are backend code
(`tape_gradients` on TensorFlow, `probe_gradients` on JAX); both return a
`Forward` with the same contract, which the rest of the step
(`training.train_step`) reads.
"""

import collections

# y_pred: the model's outputs. loss: the unscaled training loss.
# grads: one per trainable variable, `None` for factored-order kernels.
# calls: the recorded `LayerCall`s. output_grads: the gradient of the
# scaled loss at each call's outputs where `wanted_outputs` asks for it,
# else `None`. fisher_grads: those of the sampled Fisher's loss (every call)
# with `fisher="sampled"`, else `output_grads`.
Forward = collections.namedtuple(
    "Forward",
    ["y_pred", "loss", "grads", "calls", "output_grads", "fisher_grads"],
)


def wanted_outputs(plan, calls, refresh):
    """`(skipped, needed)`: the ids of the kernels whose gradient the step
    forms itself (the factored order: the backward pass need not compute
    it), and the positions of the calls whose output gradient the step
    reads (every call if `refresh`, the factored-order calls otherwise)."""
    factored = [
        p
        for p, call in enumerate(calls)
        if plan.variable_index(call.block.kernel) in plan.factored_kernels
    ]
    skipped = {id(calls[p].block.kernel) for p in factored}
    needed = [p for p in range(len(calls)) if refresh or p in factored]
    return skipped, needed
