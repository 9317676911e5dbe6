"""Why `THOR.recommended()` trails AdamW on an EfficientNetB0 from scratch.

The setup a new user tried (issue 50): `keras.applications.EfficientNetB0`
(`weights=None`, 32×32×3 inputs, 10 classes) on 256 random images with
random labels, 3 epochs at batch 32, seed 0: how fast each optimizer fits
the training set. Candidates, each from the same initial weights:

- `AdamW(1e-3)`, Keras's;
- `THOR.recommended()`, and the same with its step-size guard changed
  (`kl_clip=0.1`, `kl_clip=None`) or a larger damping (`damping=0.3`).

Prints, per candidate and epoch, the training loss and accuracy and the
mean of THOR's guard scale `ν` (`thor_guard_scale`, 1 = the step is not
clipped), and the seconds of the run (compilation included), and writes
`results/efficientnet_guard_<backend>.json`.

Run: KERAS_BACKEND=tensorflow python benchmarks/efficientnet_guard.py
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

EPOCHS, BATCH, SEED, IMAGES = 3, 32, 0, 256
CANDIDATES = {
    "AdamW(1e-3)": lambda: keras.optimizers.AdamW(1e-3),
    "THOR.recommended()": lambda: keras_thor.optimizers.THOR.recommended(),
    "kl_clip=0.1": lambda: keras_thor.optimizers.THOR.recommended(kl_clip=0.1),
    "kl_clip=None": lambda: keras_thor.optimizers.THOR.recommended(
        kl_clip=None
    ),
    "damping=0.3": lambda: keras_thor.optimizers.THOR.recommended(damping=0.3),
}


def data():
    rng = np.random.default_rng(SEED)
    x = rng.uniform(0, 255, size=(IMAGES, 32, 32, 3)).astype("float32")
    return x, rng.integers(0, 10, IMAGES)


class GuardScales(keras.callbacks.Callback):
    """The mean guard scale of each epoch's steps."""

    def __init__(self):
        super().__init__()
        self.means, self._epoch = [], []

    def on_train_batch_end(self, batch, logs=None):
        if logs and "thor_guard_scale" in logs:
            self._epoch.append(float(logs["thor_guard_scale"]))

    def on_epoch_end(self, epoch, logs=None):
        self.means.append(float(np.mean(self._epoch)) if self._epoch else None)
        self._epoch = []


def run(name, make_optimizer, x, y):
    keras.utils.set_random_seed(SEED)
    model = keras.applications.EfficientNetB0(
        weights=None, input_shape=(32, 32, 3), classes=10
    )
    if name != "AdamW(1e-3)":
        keras_thor.convert_to_thor_model(model)
    model.compile(
        make_optimizer(),
        "sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    guard = GuardScales()
    start = time.perf_counter()
    history = model.fit(
        x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, callbacks=[guard]
    )
    return {
        "loss": history.history["loss"],
        "accuracy": history.history["accuracy"],
        "guard_scale": guard.means,
        "seconds": time.perf_counter() - start,
    }


def main():
    x, y = data()
    results = {}
    for name, make_optimizer in CANDIDATES.items():
        results[name] = row = run(name, make_optimizer, x, y)
        guard = ", ".join(
            "-" if g is None else f"{g:.2f}" for g in row["guard_scale"]
        )
        print(
            f"{name:20s} loss {' '.join(f'{v:.2f}' for v in row['loss'])}"
            f"  accuracy {' '.join(f'{v:.3f}' for v in row['accuracy'])}"
            f"  guard {guard}  {row['seconds']:.0f} s",
            flush=True,
        )
    out = pathlib.Path("results")
    out.mkdir(exist_ok=True)
    path = out / f"efficientnet_guard_{keras.backend.backend()}.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
