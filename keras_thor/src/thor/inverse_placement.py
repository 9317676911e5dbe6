"""Which replica inverts which layer's factors (KAISA-style spreading)."""

import heapq


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
