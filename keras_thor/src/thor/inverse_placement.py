"""Which replica inverts which layer's factors (KAISA-style spreading)."""

import heapq

from keras import ops

from keras_thor.src.distribute import replicas


def inversion_cost(inverse_shapes):
    """Flops-proportional cost of inverting blocks of the given shapes.

    A block inverse `(n, s, s)` costs about `n·s³`; a diagonal `(d,)` one
    about `d`.
    """
    cost = 0
    for shape in inverse_shapes:
        if len(shape) == 1:
            cost += shape[0]
        else:
            blocks, size, _ = shape
            cost += blocks * size**3
    return cost


def inverse_owners(costs, replicas):
    """The replica that inverts each layer: `[owner of layer i]`.

    Largest layer first to the least loaded replica (longest-processing-
    time greedy), ties to the lower replica and, among equal costs, the
    earlier layer first, so every replica computes the same placement.
    """
    owners = [0] * len(costs)
    loads = [(0, replica) for replica in range(replicas)]
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    for layer in order:
        load, replica = heapq.heappop(loads)
        owners[layer] = replica
        heapq.heappush(loads, (load + costs[layer], replica))
    return owners


def spread_over_replicas(computations, shapes, refresh):
    """Runs each layer's inversion on one replica and shares the results.

    `computations[k]()` gives layer `k`'s `(A⁻¹, G⁻¹, trouble)`, of the
    shapes `shapes[k]`; it runs on the replica `inverse_owners` gives it
    (and nowhere if `refresh[k]`, a boolean tensor or `None` for always,
    is false), the other replicas contribute zeros, and one all-reduce
    sums them. Returns `[(A⁻¹, G⁻¹, trouble)]`, zeros where not refreshed.
    """
    owners = inverse_owners(
        [inversion_cost(pair) for pair in shapes], replicas.replica_count()
    )
    this_replica = replicas.replica_id()
    flat = []
    for compute, (a_shape, g_shape), owner, wanted in zip(
        computations, shapes, owners, refresh
    ):

        def mine(compute=compute):
            a_inverse, g_inverse, trouble = compute()
            return a_inverse, g_inverse, ops.cast(trouble, "float32")

        def others(a_shape=a_shape, g_shape=g_shape):
            return (
                ops.zeros(a_shape, "float32"),
                ops.zeros(g_shape, "float32"),
                ops.convert_to_tensor(0.0),
            )

        owns = this_replica == owner
        if wanted is not None:
            owns = ops.logical_and(owns, wanted)
        if isinstance(owns, bool):
            parts = mine() if owns else others()
        else:
            parts = ops.cond(owns, mine, others)
        flat.extend(parts)
    flat = replicas.all_reduce_sum(flat)
    return [
        (flat[3 * k], flat[3 * k + 1], flat[3 * k + 2] > 0)
        for k in range(len(computations))
    ]
