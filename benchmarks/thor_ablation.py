"""From MindSpore's THOR rule to a K-FAC-grade setting, one change at a time.

Benchmark 1's protocol (`harness.run`: the task's data,
seed, initial weights, shuffles, checks and stored target), seed 0, one
learning rate and damping for every rung, so that each row differs from
the one above it by one option:

0. MindSpore's rule: `√λ` on both factors, statistics on refresh steps
   only, `frequency=5`, `split_dim=128`, biases first-order;
1. + `damping_split="pi"` (Martens & Grosse's π);
2. + statistics every step into an average (`statistics_frequency=1`,
   `factor_decay=0.95`);
3. + `burn_in_steps=10` (statistics-only steps before the first update);
4. + `precondition_biases="joint"` (`[x, 1]` rows);
5. + whole factors (`split_dim=1024`, at least every factor's width);
6. - burn-in (`THOR.recommended()` has none);
7. + the KL guard (`kl_clip=0.01`);
8. + a convolution's statistics from the first 32 examples of each batch
   (`conv_statistics_rows=32`);
9. + the guard on the velocity the step leaves (`kl_clip_mode="velocity"`):
   `THOR.recommended()` exactly at its own learning rate and damping
   (1e-3, 1e-3).

    python benchmarks/thor_ablation.py --tasks mnist_mlp resnet \
        transformer autoencoder --lr 1e-3 --damping 1e-3

Prints epochs and training seconds to the target per rung (the
baselines' best points are in the protocol file) and writes
`results/thor_ablation_<task>.json`.
"""

import argparse
import json
import pathlib

import harness
import outcomes

RUNGS = (
    ("MindSpore's rule", {}),
    ("+ π damping split", {"damping_split": "pi"}),
    (
        "+ statistics every step (EMA 0.95)",
        {"statistics_frequency": 1, "factor_decay": 0.95},
    ),
    ("+ 10 burn-in steps", {"burn_in_steps": 10}),
    ("+ joint bias rows", {"precondition_biases": "joint"}),
    ("+ whole factors (split_dim 1024)", {"split_dim": 1024}),
    ("- burn-in", {"burn_in_steps": 0}),
    ("+ KL guard (kl_clip 0.01)", {"kl_clip": 0.01}),
    ("+ conv statistics from 32 examples", {"conv_statistics_rows": 32}),
    ("+ guard on the velocity: the preset", {"kl_clip_mode": "velocity"}),
)


def rung_options(index):
    """The THOR options of rung `index`: every change up to it."""
    options = {"frequency": 5, "split_dim": 128}
    for _, change in RUNGS[: index + 1]:
        options.update(change)
    return options


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["mnist_mlp"])
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--damping", type=float, required=True)
    args = parser.parse_args()
    protocol = outcomes.read(harness.RECORDED_PROTOCOL)
    for name in args.tasks:
        task = harness.TASKS[name]
        data = task.load()
        target = protocol[name]["target"]
        rows = []
        for index, (label, _) in enumerate(RUNGS):
            options = rung_options(index)

            record = harness.run_thor(
                task,
                data,
                target,
                dict(
                    learning_rate=args.lr,
                    damping=args.damping,
                    momentum=0.9,
                    **options,
                ),
            )
            reached = outcomes.outcome(record, task.higher_is_better)
            metrics = record["metrics"]["y"]
            rows.append(
                dict(
                    rung=label,
                    options=options,
                    epochs=reached[0] if reached else None,
                    seconds=reached[1] if reached else None,
                    best=outcomes.best_metric(metrics, task.higher_is_better),
                    diverged=record["diverged"],
                    error=record["error"],
                )
            )
            row = rows[-1]
            print(
                f"[{name}] {label:<36} epochs {row['epochs']} "
                f"seconds {row['seconds'] and round(row['seconds'], 2)} "
                f"best {row['best']} diverged {row['diverged']}",
                flush=True,
            )
        path = pathlib.Path("results") / f"thor_ablation_{name}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(
            json.dumps(
                dict(
                    lr=args.lr, damping=args.damping, target=target, rows=rows
                ),
                indent=1,
                default=str,
            )
        )


if __name__ == "__main__":
    main()
