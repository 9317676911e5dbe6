"""How THOR's damping, frequency and momentum for benchmark 1 were chosen.

For each model of `thor_time_to_accuracy.py`, THOR runs on the held-out
seeds 3 and 4 (the benchmark reports seeds 0, 1, 2; the seed also picks the
data split) over damping x frequency x momentum (heavy ball or Nesterov) x
its grid (learning rates x the model's decay horizons). Of the grid points
that reach the target on every held-out seed, the one with the fewest mean
epochs (then the larger damping, then the least mean time) gives the
(damping, frequency, momentum) that benchmark 1 uses; the benchmark then
runs THOR's whole grid with them on its own seeds, as it does for every
optimizer. By default frequency 2 and Nesterov momentum only: an earlier,
seed-0 search over frequency {2, 5, 10} x both momenta picked them on both
models (docs/benchmarks.md); the flags search them again.

    python benchmarks/thor_select_damping.py [--models mlp cnn]
        [--seeds 3 4] [--dampings ...] [--frequencies ...]
        [--momenta heavy-ball nesterov]
"""

import argparse
import itertools
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(__file__))

from thor_time_to_accuracy import SETUPS  # noqa: E402
from thor_time_to_accuracy import decay_name  # noqa: E402
from thor_time_to_accuracy import digits  # noqa: E402
from thor_time_to_accuracy import grid_points  # noqa: E402
from thor_time_to_accuracy import mean_reached  # noqa: E402
from thor_time_to_accuracy import run  # noqa: E402

MOMENTA = {"heavy-ball": False, "nesterov": True}


def select(model_name, seeds, dampings, frequencies, momenta):
    setup = dict(SETUPS[model_name])
    data = {seed: digits(seed, setup["images"]) for seed in seeds}
    print(
        f"\n{model_name}, seeds {', '.join(map(str, seeds))}: epochs to "
        f"{setup['target']} per (learning rate, decay), mean over the seeds"
    )
    candidates = []
    for damping, frequency, momentum in itertools.product(
        dampings, frequencies, momenta
    ):
        setup.update(
            damping=damping,
            frequency=frequency,
            use_nesterov=MOMENTA[momentum],
        )
        cells = []
        for point in grid_points(setup, "THOR"):
            trackers = [
                run(setup, "THOR", point, seed, data[seed]) for seed in seeds
            ]
            reached = mean_reached(trackers)
            lr, decay = point
            cells.append(
                f"{lr:g} {decay_name(decay)}: "
                f"{f'{reached[0]:.3g}' if reached else '-'}"
            )
            if reached:
                candidates.append((reached, damping, frequency, momentum))
        print(
            f"  damping {damping:<6g} frequency {frequency:<3} "
            f"{momentum:<10} {'  '.join(cells)}",
            flush=True,
        )
    if not candidates:
        print("  no setting reaches the target on every seed")
        return
    # Ties in epochs go to the larger damping (the better-conditioned
    # factors), not to the seconds, which move with the machine's noise.
    (epochs, seconds), damping, frequency, momentum = min(
        candidates, key=lambda c: (c[0][0], -c[1], c[0][1])
    )
    print(
        f"  chosen: damping {damping}, frequency {frequency}, {momentum} "
        f"({epochs:.3g} mean epochs, {seconds:.2f} s)"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[3, 4])
    parser.add_argument(
        "--dampings",
        type=float,
        nargs="+",
        default=[0.001, 0.003, 0.01, 0.03],
    )
    parser.add_argument("--frequencies", type=int, nargs="+", default=[2])
    parser.add_argument(
        "--momenta", nargs="+", choices=MOMENTA, default=["nesterov"]
    )
    args = parser.parse_args()
    for model_name in args.models:
        select(
            model_name,
            args.seeds,
            args.dampings,
            args.frequencies,
            args.momenta,
        )


if __name__ == "__main__":
    main()
