"""THOR's rule for variables without curvature, measured on recurrent models.

An LSTM(64) and a GRU(64) classifier (the recurrent cell holds 75-80% of
the parameters and gets no curvature) on a synthetic sequence task (the
class is the sign pattern of three running sums; 2,000 training and 400
validation sequences of 30 steps with 8 features), batch 64, 6 epochs,
seed 0 (the task of `shared/scripts/first_order_layers.py`). Each
candidate trains the same initial weights:

- `AdamW(1e-3)`, Keras's;
- `THOR.recommended(first_order="momentum")`: MindSpore's rule, THOR's
  momentum SGD on those variables at THOR's learning rate;
- `THOR.recommended(first_order="adam")`: Adam's normalized step on them.

Prints the validation accuracy after each epoch and the seconds of each
epoch (the first one includes compilation), and writes
`results/first_order_rule_<backend>.json`.

Run: KERAS_BACKEND=tensorflow python benchmarks/first_order_rule.py
"""

import json
import os
import pathlib
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_thor  # noqa: E402

EPOCHS, BATCH, SEED = 6, 64, 0
CANDIDATES = {
    "AdamW(1e-3)": lambda: keras.optimizers.AdamW(1e-3),
    'THOR first_order="momentum"': lambda: (
        keras_thor.optimizers.THOR.recommended(first_order="momentum")
    ),
    'THOR first_order="adam"': lambda: keras_thor.optimizers.THOR.recommended(
        first_order="adam"
    ),
}


def data():
    rng = np.random.default_rng(SEED)
    x = rng.normal(size=(2400, 30, 8)).astype("float32")
    sums = x[:, :, :3].sum(axis=1)
    y = (sums > 0).astype("int32") @ np.array([1, 2, 4], "int32")
    return (x[:2000], y[:2000]), (x[2000:], y[2000:])


def make_model(cell):
    keras.utils.set_random_seed(SEED)
    inputs = keras.Input((30, 8))
    hidden = cell(64)(inputs)
    hidden = keras.layers.Dense(64, activation="relu")(hidden)
    return keras.Model(inputs, keras.layers.Dense(8)(hidden))


class EpochSeconds(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)


def run(cell, name, make_optimizer, train, validation):
    model = make_model(cell)
    optimizer = make_optimizer()
    if isinstance(optimizer, keras_thor.optimizers.THOR):
        keras_thor.convert_to_thor_model(model)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    timer = EpochSeconds()
    history = model.fit(
        *train,
        batch_size=BATCH,
        epochs=EPOCHS,
        validation_data=validation,
        callbacks=[timer],
        verbose=0,
    )
    return {
        "model": cell.__name__,
        "optimizer": name,
        "val_accuracy": [float(a) for a in history.history["val_accuracy"]],
        "epoch_seconds": timer.seconds,
    }


def main():
    train, validation = data()
    records = []
    for cell in (keras.layers.LSTM, keras.layers.GRU):
        for name, make_optimizer in CANDIDATES.items():
            record = run(cell, name, make_optimizer, train, validation)
            records.append(record)
            accuracy = " ".join(f"{a:.2f}" for a in record["val_accuracy"])
            seconds = " ".join(f"{s:.1f}" for s in record["epoch_seconds"])
            print(
                f"{cell.__name__:4s} {name:28s} val accuracy {accuracy} | "
                f"epoch seconds {seconds}",
                flush=True,
            )
    out = pathlib.Path("results")
    out.mkdir(exist_ok=True)
    path = out / f"first_order_rule_{keras.backend.backend()}.json"
    path.write_text(json.dumps(records, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
