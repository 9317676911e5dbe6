"""Benchmark 1's outcomes without Keras: targets reached, best points, files.

Everything here reads or writes the records that a run of the harness
(`harness.py`) or of kfac-jax's side by side (`kfac_jax_side_by_side.py`,
whose kfac-jax virtualenv has no Keras) produces, so it imports only the
standard library and NumPy.

A curve is a dict with `epochs`, `seconds` and `metrics`, lists of the
same length, one entry per check; `select` also reads its `point` and
`diverged`. A harness record holds one curve per evaluation point: its
`metrics` is a dict `{at: [...]}` ("y" the trained weights, "x"
ScheduleFreeAdamW's average).
"""

import json
import math

import numpy as np

# The tune seed chooses each optimizer's best point; the report seeds
# measure it.
TUNE_SEED = 0
REPORT_SEEDS = (1, 2, 3)


def say(text=""):
    print(text, flush=True)


# ---------------------------------------------------------------------------
# Targets and best points


def reaches(value, target, higher_is_better):
    """Whether metric `value` is at `target` (never if either is missing
    or the value is not finite)."""
    if target is None or not math.isfinite(value):
        return False
    return value >= target if higher_is_better else value <= target


def better(a, b, higher_is_better):
    """Whether metric `a` is better than `b` (NaN is worst)."""
    if not math.isfinite(a):
        return False
    if not math.isfinite(b):
        return True
    return a > b if higher_is_better else a < b


def reached(epochs, seconds, metrics, target, higher_is_better):
    """(epochs, seconds) at the first check at the target, or None."""
    for e, s, m in zip(epochs, seconds, metrics):
        if reaches(m, target, higher_is_better):
            return e, s
    return None


def select(curves, target, higher_is_better):
    """The point of the curve with the fewest epochs to `target` (ties:
    less time, then the first); if none reaches it, the closest point
    (best final metric, a diverged curve's counting as NaN), marked
    `reached=False`."""
    candidates = []
    closest = None
    for curve in curves:
        got = reached(
            curve["epochs"],
            curve["seconds"],
            curve["metrics"],
            target,
            higher_is_better,
        )
        if got:
            candidates.append((got, curve["point"]))
        final = (
            curve["metrics"][-1]
            if curve["metrics"] and not curve["diverged"]
            else float("nan")
        )
        if closest is None or better(final, closest[0], higher_is_better):
            closest = (final, curve["point"])
    if candidates:
        (epochs, seconds), point = min(candidates, key=lambda c: c[0])
        return dict(point=point, epochs=epochs, seconds=seconds, reached=True)
    point = closest[1] if closest else None
    return dict(point=point, epochs=None, seconds=None, reached=False)


def evaluation_point(record, at=None):
    """`at`, else the record's own evaluation point ("y" unless its point
    says "x")."""
    return at or record["point"].get("at") or "y"


def outcome(record, higher_is_better, at=None):
    """(epochs, seconds) to a harness record's target at evaluation point
    `at`, or None (not reached, diverged or failed)."""
    at = evaluation_point(record, at)
    if record["target"] is None or at not in record["metrics"]:
        return None
    return reached(
        record["epochs"],
        record["seconds"],
        record["metrics"][at],
        record["target"],
        higher_is_better,
    )


def metric_at(record, at, epoch):
    """A harness record's metric at the check that ends epoch `epoch`
    (NaN if none)."""
    for e, m in zip(record["epochs"], record["metrics"][at]):
        if abs(e - epoch) < 1e-9:
            return m
    return float("nan")


def summary(record, higher_is_better, at=None):
    """One line on a harness record: the target, the best metric, how it
    ended."""
    at = evaluation_point(record, at)
    if record["error"]:
        return f"failed ({record['error']})"
    if record["diverged"] and not record["epochs"]:
        return "diverged at once"
    got = outcome(record, higher_is_better, at)
    values = [v for v in record["metrics"].get(at, []) if math.isfinite(v)]
    best = best_metric(values, higher_is_better)
    text = "" if best is None else f"best {best:.4g}"
    if got:
        text = f"target at {got[0]:.3g} epochs, {got[1]:.2f} s; " + text
    elif record["target"] is not None:
        text = "target not reached; " + text
    if record["diverged"]:
        done = record["epochs"][-1] if record["epochs"] else 0
        text += f"; diverged after {done:.3g} epochs"
    if record["capped"] and not got:
        text += (
            f"; stopped at the time cap after {record['epochs'][-1]:.3g} epochs"
        )
    return text


# ---------------------------------------------------------------------------
# Numbers for tables


def best_metric(values, higher_is_better):
    """The best of `values`; None if there are none."""
    if not values:
        return None
    return (max if higher_is_better else min)(values)


def median(values):
    """The median; infinity (not reached) for no values."""
    return float(np.median(values)) if values else float("inf")


def fmt(value, digits=3):
    """`digits` significant digits; "-" for None or non-finite (not
    reached)."""
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:.{digits}g}"


def fmt_range(values):
    """min..max; "-" where not reached."""
    if not any(math.isfinite(v) for v in values):
        return "-"
    return f"{fmt(min(values))}..{fmt(max(values))}"


def describe(point):
    """A grid point as "lr schedule [at x]"."""
    text = f"{point['lr']:g} {point['schedule']}"
    if point.get("at"):
        text += f" at {point['at']}"
    return text


# ---------------------------------------------------------------------------
# Files


def read(path):
    """A JSON file's content; {} if there is none."""
    if path.exists():
        return json.loads(path.read_text())
    return {}


def write(path, content):
    """`content` as JSON (`plain`), replacing `path` in one move."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(plain(content), indent=1))
    tmp.replace(path)


def plain(value):
    """JSON-ready: NumPy scalars as Python ones, non-finite floats (not
    reached) as null."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (np.floating, np.integer)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
