"""THOR's curvature math and the ASGD/SAG steps on a GPU, JAX and torch.

THOR trains on TensorFlow only, but its curvature math (block-diagonal
damped inverses, the π split) is `keras.ops` and the optimizers run on
every backend. This script times, on the backend `KERAS_BACKEND` names
and the device it sees:

- THOR's inversion of one `d`-wide factor (cut into diagonal blocks,
  damped, inverted: `damped_inverse_of_blocks`), whole (`split_dim ≥ d`)
  and cut every 1,024 (THOR's refresh-step inverse), median of `--repeats`
  after warm-up, with the device synchronised;
- one `mixed_bfloat16` fit of an MLP with ASGD (state stays float32).

The step times of ASGD and SAG against SGD come from
`benchmarks/optimizer_step_time.py`, run on the same backend.

    KERAS_BACKEND=jax python benchmarks/gpu_backends.py [--repeats 20]
"""

import argparse
import os
import time

import keras
import numpy as np

import keras_thor
from keras_thor.src.thor.block_inverse import damped_inverse_of_blocks
from keras_thor.src.thor.block_inverse import diagonal_blocks

DIMS = (256, 1024, 2048, 4096)


def _device():
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return str(jax.devices()[0])
    if backend == "torch":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
        return "cpu"
    return "tensorflow default device"


def _synchronise(value):
    backend = keras.backend.backend()
    if backend == "jax":
        value.block_until_ready()
    elif backend == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
    else:
        keras.ops.convert_to_numpy(value)


def _inverse_function(split_dim):
    def inverse(factor):
        blocks = diagonal_blocks(factor, split_dim)
        layout = (1, factor.shape[-1])
        return damped_inverse_of_blocks(blocks, 0.01, layout)[0]

    if keras.backend.backend() == "jax":
        import jax

        return jax.jit(inverse)
    return inverse


def time_inverses(repeats):
    rng = np.random.default_rng(0)
    print(f"{'d':>5} {'split_dim':>9} {'ms (median)':>12}")
    for dim in DIMS:
        rows = rng.normal(size=(2 * dim, dim)).astype("float32")
        factor = keras.ops.convert_to_tensor((rows.T @ rows / (2 * dim))[None])
        for split_dim in sorted({dim, min(dim, 1024)}, reverse=True):
            inverse = _inverse_function(split_dim)
            _synchronise(inverse(factor))  # trace, compile, warm up
            seconds = []
            for _ in range(repeats):
                start = time.perf_counter()
                _synchronise(inverse(factor))
                seconds.append(time.perf_counter() - start)
            print(f"{dim:>5} {split_dim:>9} {1e3 * np.median(seconds):>12.3f}")


def mixed_precision_fit():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = keras.Sequential(
            [
                keras.Input((784,)),
                keras.layers.Dense(1024, "relu"),
                keras.layers.Dense(10, dtype="float32"),
            ]
        )
        optimizer = keras_thor.optimizers.ASGD(learning_rate=0.01, t0=2)
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        rng = np.random.default_rng(0)
        x = rng.normal(size=(1000, 784)).astype("float32")
        y = rng.integers(0, 10, size=(1000,))
        history = model.fit(x, y, batch_size=128, epochs=2, verbose=0)
        dtypes = sorted({v.dtype for v in optimizer.variables})
        print(
            f"mixed_bfloat16 ASGD: losses {history.history['loss']}, "
            f"optimizer state dtypes {dtypes}"
        )
    finally:
        keras.mixed_precision.set_global_policy("float32")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(
        f"keras {keras.__version__}, backend {keras.backend.backend()}, "
        f"device {_device()}, {os.cpu_count()} CPUs"
    )
    time_inverses(args.repeats)
    mixed_precision_fit()


if __name__ == "__main__":
    main()
