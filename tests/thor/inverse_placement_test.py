"""Which replica inverts which layer when THOR spreads its inverses."""

import pytest

from keras_thor.src.thor.inverse_placement import inverse_owners
from keras_thor.src.thor.inverse_placement import inversion_cost


def test_inversion_cost_counts_cubed_blocks_and_diagonals():
    assert inversion_cost([(2, 8, 8), (1, 3, 3)]) == 2 * 512 + 27
    assert inversion_cost([(100,), (1, 4, 4)]) == 100 + 64


def test_largest_first_to_the_least_loaded_replica():
    # 9 to replica 0, then 5 and 4 to replica 1 (loads 9 and 9).
    assert inverse_owners([4, 9, 5], 2) == [1, 0, 1]
    assert inverse_owners([1, 1, 1, 1], 2) == [0, 1, 0, 1]


@pytest.mark.parametrize("replicas", [1, 2, 3, 4, 8])
def test_every_layer_has_one_owner_and_loads_balance(replicas):
    costs = [((7 * i) % 11 + 1) ** 3 for i in range(13)]
    owners = inverse_owners(costs, replicas)
    assert len(owners) == len(costs)
    assert set(owners) <= set(range(replicas))
    loads = [
        sum(c for c, o in zip(costs, owners) if o == r) for r in range(replicas)
    ]
    # Greedy bound: no replica exceeds the mean by more than the largest.
    assert max(loads) <= sum(costs) / replicas + max(costs)
    assert inverse_owners(costs, replicas) == owners


def test_more_replicas_than_layers_leaves_some_idle():
    assert inverse_owners([8, 27], 4) == [1, 0]
