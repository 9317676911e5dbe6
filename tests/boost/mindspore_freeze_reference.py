"""Literal NumPy transcription of MindSpore's gradient-freeze helpers.

Used only as a test reference; it imports nothing but NumPy.

Source transcribed from:
    repo:   mindspore-ai/mindspore (GitHub mirror)
    path:   mindspore/python/mindspore/boost/grad_freeze.py
    commit: 059debf770d984fe9d5a7b87246ec81ee495b1a4
            (the two functions below are character-for-character the same
            at commit 851de9d79169aae9165cf83ab636216fc52b33af)
    parts:  ``GradientFreeze.split_parameters_groups`` and
            ``GradientFreeze.generate_freeze_index_sequence``

Seeding: MindSpore draws from the global ``np.random`` state.
``mindspore.set_seed(seed)`` calls ``np.random.seed(seed)``
(``mindspore/python/mindspore/common/seed.py``, commit
03b856c9529007a7768fde8bc896e5fb4a75d9e2), so this reference calls
``np.random.seed(seed)`` before running MindSpore's code.

The only adaptations are: the methods are free functions (no ``self``),
``split_parameters_groups`` takes a list of parameter name strings in
definition order instead of ``net`` (so ``para.name`` is the string
itself), and ``generate_freeze_index_sequence`` takes a ``seed``.
The arithmetic, loop conditions and RNG calls are kept as written.
"""

import numpy as np

CONTINUOUS_STRATEGY = 0
INTERVAL_STRATEGY = 1


def split_parameters_groups(names, n):
    """MindSpore ``split_parameters_groups(net, freeze_para_groups_number)``.

    ``names`` stands in for ``net.trainable_params()`` (names in definition
    order). Returns ``n`` groups; group ``i`` is the concatenation of the
    "layer units" ``grouped_params[i * stride:]`` (a suffix). If there are
    fewer units than ``n`` then ``stride == 0`` and every group holds all
    names.
    """
    freeze_para_groups_number = n
    grouped_params = []
    tmp = []
    for para in names:
        name = para
        # ensure 'bn' after 'conv' is not split
        if "bn" in name or "bias" in name:
            tmp.append(para)
        elif len(tmp) >= 3:
            grouped_params.append(tmp)
            tmp = [para]
        else:
            tmp.append(para)
    if tmp:
        grouped_params.append(tmp)
    stride = len(grouped_params) // freeze_para_groups_number
    freeze_grouped_params = [
        sum(grouped_params[i * stride :], [])
        for i in range(freeze_para_groups_number)
    ]
    return freeze_grouped_params


def generate_freeze_index_sequence(
    parameter_groups_number, freeze_strategy, freeze_p, total_steps, seed
):
    """MindSpore ``generate_freeze_index_sequence``, after seeding NumPy.

    Entry ``t`` is the index of the parameter group trained at step ``t``
    (0 means the whole network). ``freeze_strategy`` 0 is CONTINUOUS
    ("00001234"), 1 is INTERVAL ("01020304").
    """
    np.random.seed(seed)
    total_step = int(total_steps * 1.01)
    if parameter_groups_number <= 1:
        return [0 for _ in range(total_step)]
    # local continuous freezing training strategy, as '00001234'
    if freeze_strategy == CONTINUOUS_STRATEGY:
        zero_cnt = int(
            freeze_p * (parameter_groups_number - 1) // (1 - freeze_p) + 0.5
        )
        sub_idx = [0] * zero_cnt + list(range(1, parameter_groups_number))
        freeze_idxes = []
        while len(freeze_idxes) < total_step:
            freeze_idxes += sub_idx
        return freeze_idxes
    # interval freezing training strategy, as '01020304'
    if freeze_strategy == INTERVAL_STRATEGY:
        index_all = list(range(1, parameter_groups_number))
        prob = [x / sum(index_all) for x in index_all]
        freeze_idxes = [0]
        zero_cnt = 1
        freeze_cnt = 0
        while len(freeze_idxes) < total_step:
            freeze_p_cur = 1.0 * freeze_cnt / (zero_cnt + freeze_cnt)
            if freeze_p_cur < 1 - freeze_p:
                freeze_idxes.append(
                    int(np.random.choice(index_all[::-1], p=prob))
                )
                freeze_cnt += 1
            else:
                freeze_idxes.append(0)
                zero_cnt += 1
        return freeze_idxes
    raise ValueError(
        f"Unsupported freezing training strategy '{freeze_strategy}'"
    )


if __name__ == "__main__":
    n, freeze_p, total_steps, seed = 10, 0.7, 1000, 0
    for label, strategy in (
        ("CONTINUOUS", CONTINUOUS_STRATEGY),
        ("INTERVAL", INTERVAL_STRATEGY),
    ):
        seq = generate_freeze_index_sequence(
            n, strategy, freeze_p, total_steps, seed
        )
        zero_frac = seq.count(0) / len(seq)
        print(f"{label} (freeze_type={strategy}) len={len(seq)}")
        print("  first 30:", " ".join(str(v) for v in seq[:30]))
        print(f"  fraction of zeros: {zero_frac:.4f}")
