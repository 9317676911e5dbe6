"""GradientFreeze's pure pieces: layer units, suffix groups, index sequence.

Transcribed from MindSpore's `boost/grad_freeze.py`
(`GradientFreeze.split_parameters_groups` and
`generate_freeze_index_sequence`), with its arithmetic kept.
"""

import numpy as np

CONTINUOUS = 0
INTERVAL = 1


def layer_units(attaches):
    """Index lists of MindSpore's "layer units" of parameters.

    `attaches[i]` says parameter `i` joins the unit before it (MindSpore:
    a batch-norm or bias parameter stays with its convolution). A new unit
    starts at a parameter that does not attach once the current unit holds
    at least 3 parameters.
    """
    units = []
    current = []
    for index, attach in enumerate(attaches):
        if not attach and len(current) >= 3:
            units.append(current)
            current = []
        current.append(index)
    if current:
        units.append(current)
    return units


def suffix_groups(units, groups_number):
    """Parameter indices of each group: group `i` is the suffix of the
    network from unit `i · stride`, `stride = len(units) // groups_number`
    (every group is the whole network when there are fewer units)."""
    stride = len(units) // groups_number
    return [
        [index for unit in units[i * stride :] for index in unit]
        for i in range(groups_number)
    ]


def freeze_index_sequence(
    groups_number, freeze_type, freeze_p, total_steps, seed
):
    """The group trained at each step, `int(total_steps · 1.01)` or more.

    - `freeze_type=0` (continuous, "00001234"): periods of
      `z = int(p(n−1) // (1−p) + 0.5)` zeros then `1, ..., n−1`.
    - `freeze_type=1` (interval, "01020304"): after a leading 0, a frozen
      step is drawn whenever the frozen fraction so far is below `1 − p`,
      its group `k` with probability `(n − k) / (n(n−1)/2)`; otherwise 0.

    Notation:
        - `n`: `groups_number`; `p`: `freeze_p`, the fraction of steps
          that train every group (index 0).

    Draws come from `np.random.RandomState(seed)`, the stream MindSpore's
    `np.random.choice` calls consume after `np.random.seed(seed)`.
    """
    length = int(total_steps * 1.01)
    if groups_number <= 1:
        return np.zeros(length, dtype=np.int64)
    if freeze_type == CONTINUOUS:
        if freeze_p == 1.0:
            return np.zeros(length, dtype=np.int64)
        zeros = int(freeze_p * (groups_number - 1) // (1 - freeze_p) + 0.5)
        period = [0] * zeros + list(range(1, groups_number))
        return np.array(period * -(-length // len(period)), dtype=np.int64)
    frozen = np.zeros(length, dtype=bool)
    zero_count, freeze_count = 1, 0
    for step in range(1, length):
        if freeze_count / (zero_count + freeze_count) < 1 - freeze_p:
            frozen[step] = True
            freeze_count += 1
        else:
            zero_count += 1
    indices = np.arange(1, groups_number)
    probabilities = indices / indices.sum()
    # `np.random.choice(indices[::-1], p=probabilities)`, one draw a call.
    cdf = probabilities.cumsum()
    cdf /= cdf[-1]
    uniforms = np.random.RandomState(seed).random_sample(freeze_count)
    sequence = np.zeros(length, dtype=np.int64)
    sequence[frozen] = indices[::-1][cdf.searchsorted(uniforms, side="right")]
    return sequence
