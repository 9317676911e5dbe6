"""What a traced step runs: op counts of a `tf.function`'s graphs."""

import collections

from keras_thor.src import keras_internals


def traced_op_counts(function):
    """`Counter` of op types over every graph `function` has traced.

    Nested functions (the branches of a `cond`, the body of a loop, the
    per-replica function of a strategy) are counted too. The tests and
    benchmarks read collectives (`CollectiveReduceV2`) and factorizations
    (`Cholesky`) of THOR's steps from it.
    """
    counts = collections.Counter()
    for concrete in keras_internals.concrete_functions(function):
        graph = concrete.graph.as_graph_def()
        counts.update(node.op for node in graph.node)
        for library_function in graph.library.function:
            counts.update(node.op for node in library_function.node_def)
    return counts
