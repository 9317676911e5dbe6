"""THOR's step cost under `keras.distribution.DataParallel` on JAX.

Under `DataParallel` every device holds the whole of THOR's state and
repeats every inversion (docs/thor.md, "keras.distribution"). This script
measures what that repetition costs: benchmark 2's models (the digits MLP
and CNN of `thor_step_cost.py`, same batch sizes, the last partial batch
dropped so that the devices divide every batch), in `model.fit`, on one
device and then under `DataParallel` over every device, at the same global
batch: SGD with momentum, THOR's non-refresh step and THOR's refresh step
(every second step), the median step of a callback timer over the rounds.
The refresh step less the non-refresh step is what a refresh adds (the
statistics, their all-reduce and the inversions); spreading the
inversions over the devices could take at most `(devices - 1) / devices`
of the inversions' part of it.

Run on the JAX backend; `--devices N` host devices are made with
`XLA_FLAGS=--xla_force_host_platform_device_count=N`, set before JAX starts
(on a machine with accelerators, the accelerators are used instead).

    KERAS_BACKEND=jax python benchmarks/thor_data_parallel_cost.py \
        [--models mlp cnn] [--rounds 3] [--devices 2]
"""

import argparse
import os
import sys


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--devices", type=int, default=2)
    return parser.parse_args()


ARGS = _parse()
os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault(
    "XLA_FLAGS", f"--xla_force_host_platform_device_count={ARGS.devices}"
)
sys.path.insert(0, os.path.dirname(__file__))

import keras  # noqa: E402
from tasks import digits  # noqa: E402
from thor_step_cost import SETUPS  # noqa: E402
from thor_step_cost import StepTimer  # noqa: E402
from thor_step_cost import fit_model  # noqa: E402
from thor_step_cost import median_step  # noqa: E402
from thor_step_cost import thor_or_baseline_model  # noqa: E402

import keras_thor  # noqa: E402


def _steps(setup, x, y, distribution, rounds):
    """Median seconds of SGD's step, THOR's non-refresh step and THOR's
    refresh step, trained under `distribution` (`None`: one device)."""
    batch = setup["batch"]
    keras.distribution.set_distribution(distribution)
    try:

        def thor(frequency):
            return keras_thor.optimizers.THOR(
                0.01, setup["damping"], 0.9, frequency=frequency
            )

        runs = {
            "sgd": thor_or_baseline_model(
                setup, keras.optimizers.SGD(0.01, momentum=0.9)
            ),
            "plain": thor_or_baseline_model(setup, thor(10**9)),
            "refresh": thor_or_baseline_model(setup, thor(2)),
        }
        for model in runs.values():  # trace, compile, warm up
            fit_model(model, x, y, batch, 1)
        timers = {name: StepTimer() for name in runs}
        for _ in range(rounds):
            for name, model in runs.items():
                model.optimizer.iterations.assign(0)
                fit_model(model, x, y, batch, 2, timers[name])
    finally:
        keras.distribution.set_distribution(None)
    return (
        median_step(timers["sgd"], lambda s: True),
        median_step(timers["plain"], lambda s: s > 0),
        median_step(timers["refresh"], lambda s: s % 2 == 0),
    )


def main():
    if keras.backend.backend() != "jax":
        raise SystemExit("Run with KERAS_BACKEND=jax (keras.distribution).")
    devices = keras.distribution.list_devices()
    print(
        f"keras {keras.__version__}, backend jax, {os.cpu_count()} CPUs, "
        f"{len(devices)} devices ({devices[0]} ...)"
    )
    for name in ARGS.models:
        setup = SETUPS[name]
        batch = setup["batch"]
        x, _, y, _ = digits(0, setup["images"])
        whole = len(x) // batch * batch
        x, y = x[:whole], y[:whole]
        print(f"\n{name}: global batch {batch}, {whole // batch} steps/epoch")
        print(
            f"  {'devices':<10}{'SGD':>8}{'plain':>8}{'refresh':>9}"
            f"{'refresh-plain':>15}  (ms, median step)"
        )
        rows = {
            1: _steps(setup, x, y, None, ARGS.rounds),
            len(devices): _steps(
                setup,
                x,
                y,
                keras.distribution.DataParallel(devices=devices),
                ARGS.rounds,
            ),
        }
        for count, (sgd, plain, refresh) in rows.items():
            print(
                f"  {count:<10}{1e3 * sgd:8.2f}{1e3 * plain:8.2f}"
                f"{1e3 * refresh:9.2f}{1e3 * (refresh - plain):15.2f}"
            )
        (_, plain_1, refresh_1), (_, plain_n, refresh_n) = rows.values()
        print(
            f"  a refresh adds {1e3 * (refresh_n - plain_n):.2f} ms on "
            f"{len(devices)} devices against {1e3 * (refresh_1 - plain_1):.2f}"
            " ms on one"
        )


if __name__ == "__main__":
    main()
