"""A candidate `THOR.recommended()` setting over learning rate × damping,
on benchmark 1's tasks and seed 0 (the tune seed), against the stored
targets.

Each run is benchmark 1's (`harness.run`: the task's data,
seed, initial weights, shuffles, checks and target, stopping at the
target); the candidate's options are JSON:

    python benchmarks/thor_preset_search.py --tag kfac \\
        --options '{"damping_split": "pi", "statistics_frequency": 1}' \\
        --lrs 1e-3 3e-3 --dampings 1e-3 1e-2 --tasks resnet mnist_mlp

Prints epochs and training seconds to the target per point and appends
the records to `results/thor_preset_search_<tag>.json`.
"""

import argparse
import json
import pathlib

import harness
import outcomes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", required=True)
    parser.add_argument("--options", default="{}")
    parser.add_argument("--tasks", nargs="+", default=list(harness.TASKS))
    parser.add_argument("--lrs", nargs="+", type=float, required=True)
    parser.add_argument("--dampings", nargs="+", type=float, required=True)
    parser.add_argument("--momentum", type=float, default=0.9)
    args = parser.parse_args()
    options = json.loads(args.options)
    protocol = outcomes.read(harness.RECORDED_PROTOCOL)
    path = pathlib.Path("results") / f"thor_preset_search_{args.tag}.json"
    path.parent.mkdir(exist_ok=True)
    rows = json.loads(path.read_text()) if path.exists() else []
    for name in args.tasks:
        task = harness.TASKS[name]
        data = task.load()
        target = protocol[name]["target"]
        for damping in args.dampings:
            for lr in args.lrs:
                record = harness.run_thor(
                    task,
                    data,
                    target,
                    dict(
                        learning_rate=lr,
                        damping=damping,
                        momentum=args.momentum,
                        **options,
                    ),
                )
                reached = outcomes.outcome(record, task.higher_is_better)
                metrics = record["metrics"]["y"]
                best = outcomes.best_metric(metrics, task.higher_is_better)
                row = dict(
                    task=name,
                    lr=lr,
                    damping=damping,
                    options=options,
                    momentum=args.momentum,
                    epochs=reached[0] if reached else None,
                    seconds=reached[1] if reached else None,
                    best=best,
                    last=metrics[-1] if metrics else None,
                    diverged=record["diverged"],
                    error=record["error"],
                    warmup=record["warmup_seconds"],
                    wall=record["wall_seconds"],
                )
                rows.append(row)
                path.write_text(json.dumps(rows, indent=1, default=str))
                seconds = row["seconds"] and round(row["seconds"], 2)
                print(
                    f"[{name}] lr {lr:g} λ {damping:g}: epochs "
                    f"{row['epochs']} s {seconds}"
                    f" best {best} last {row['last']} diverged "
                    f"{row['diverged']} warm {record['warmup_seconds']:.1f}"
                    f" wall {record['wall_seconds']:.1f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
