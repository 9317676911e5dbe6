"""Optimizer state in bytes: THOR.recommended() against AdamW and Muon.

Builds each model's variables and each optimizer's state (no training) and
sums the bytes of the optimizer's variables: keras-hub's families at the
tiny configs of `tests/thor/users_models_test.py`, and a GPT-2 of 124M
parameters' shapes (12 layers, width 768, vocabulary 50,257, context
1,024). THOR's state is its momenta, its factors' averages and inverses
(blocks of `split_dim`), and Adam's second moments of the variables without
curvature (`first_order="adam"`). Prints a table and writes
`results/optimizer_memory.json`.

Run: KERAS_BACKEND=tensorflow python benchmarks/optimizer_memory.py
"""

import json
import math
import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

import keras_thor  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from tests.thor.users_models_test import keras_hub_families  # noqa: E402

OPTIMIZERS = {
    "AdamW": lambda: keras.optimizers.AdamW(1e-3),
    "Muon": lambda: keras.optimizers.Muon(1e-3),
    "THOR.recommended()": lambda: keras_thor.optimizers.THOR.recommended(
        batch_size=8
    ),
}


def _models():
    for family, (class_name, config, _) in sorted(keras_hub_families().items()):
        yield (
            family,
            lambda c=class_name, k=config: getattr(keras_hub.models, c)(**k),
        )
    yield (
        "gpt2_124m",
        lambda: keras_hub.models.GPT2Backbone(
            vocabulary_size=50257,
            num_layers=12,
            num_heads=12,
            hidden_dim=768,
            intermediate_dim=3072,
            max_sequence_length=1024,
        ),
    )


def _bytes(variables):
    return sum(
        math.prod(v.shape) * np.dtype(v.dtype).itemsize for v in variables
    )


def measure(make_model):
    row = {}
    for name, make_optimizer in OPTIMIZERS.items():
        model = make_model()
        optimizer = make_optimizer()
        if isinstance(optimizer, keras_thor.optimizers.THOR):
            keras_thor.convert_to_thor_model(model)
        optimizer.build(model.trainable_variables)
        row["parameters"] = sum(
            math.prod(v.shape) for v in model.trainable_variables
        )
        row["weights_bytes"] = _bytes(model.trainable_variables)
        row[name] = _bytes(optimizer.variables)
    return row


def main():
    rows = {}
    print(
        f"{'model':12s} {'parameters':>12s} "
        + " ".join(f"{name:>20s}" for name in OPTIMIZERS)
        + "   (MB of optimizer state; ratio to the weights)"
    )
    for family, make_model in _models():
        row = measure(make_model)
        rows[family] = row
        cells = " ".join(
            f"{row[n] / 1e6:10.2f} ({row[n] / row['weights_bytes']:4.2f}x)"
            for n in OPTIMIZERS
        )
        print(f"{family:12s} {row['parameters']:12,d} {cells}", flush=True)
    out = pathlib.Path("results")
    out.mkdir(exist_ok=True)
    (out / "optimizer_memory.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
