"""This module turns where a run's time went into accelerator-hours and dollars, and says it in words (pure: standard library only).

Each metrics row's `cost` (records.StageCost) has the seconds the loop waited on each stage and the
seconds each pool was busy. On a cluster a pool's accelerator-hours are its busy seconds times the
GPUs one of its calls holds (envs.py's resources), over 3600; at a price table (--prices, over
config.constants.LIST_PRICES) they are dollars. A warm pool's idle replicas are billed too, and how
many there were is the autoscaler's choice, which the driver does not see: the figures are what
the run's calls used, a lower bound of the bill.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# A pool's accelerators: (type, count) per call, e.g. ("L4", 1); pools without one (score, driver) absent.
Accelerators = Mapping[str, tuple[str, int]]

# The stages the loop waits on, in the order a person reads them (StageCost's wait_* and driver_s).
WAIT_STAGES = ("generate", "score", "train", "eval", "driver")


def cluster_accelerators(gpus: Mapping[str, str], train_nodes: int = 1) -> dict[str, tuple[str, int]]:
    """Each GPU pool's accelerators from its flyte.Resources GPU string ('L4:1', 'A100:4'): the train
    step's count times its nodes."""
    pools = {}
    for pool, gpu in gpus.items():
        name, _, count = gpu.partition(":")
        pools[pool] = (name, int(count or 1) * (train_nodes if pool == "train" else 1))
    return pools


def accelerator_hours(busy_s: Mapping[str, float], accelerators: Accelerators) -> dict[str, float]:
    """Each pool's accelerator-hours: busy seconds x accelerators per call / 3600."""
    return {pool: busy_s.get(pool, 0.0) * count / 3600.0 for pool, (_, count) in accelerators.items()}


def prices_with_defaults(prices: Mapping[str, float], defaults: Mapping[str, float]) -> dict[str, float]:
    """The price table: the defaults (list prices), each type given replacing its default."""
    return {**defaults, **prices}


def pool_dollars(hours: Mapping[str, float], accelerators: Accelerators, prices: Mapping[str, float]) -> dict[str, float | None]:
    """Each pool's dollars: its accelerator-hours x the hourly price of its type (None: no price for it)."""
    return {pool: (h * prices[accelerators[pool][0]] if accelerators[pool][0] in prices else None) for pool, h in hours.items()}


def totals(history: Sequence[Mapping[str, object]]) -> dict[str, float]:
    """The sums over the rows of every StageCost figure they carry (rows without one left out):
    the run's wall seconds, waits, busy seconds, accelerator-hours, dollars."""
    summed: dict[str, float] = {}
    for row in history:
        if not isinstance(row.get("wall_s"), (int, float)):
            continue
        for key, value in row.items():
            if (key in ("wall_s", "driver_s", "accelerator_hours", "dollars") or key.startswith(("wait_", "busy_"))) and isinstance(
                value, (int, float)
            ):
                summed[key] = summed.get(key, 0.0) + float(value)
    return summed


def waits(summed: Mapping[str, float]) -> dict[str, float]:
    """The seconds the loop waited on each stage (WAIT_STAGES), from `totals`."""
    return {stage: summed.get("driver_s" if stage == "driver" else f"wait_{stage}_s", 0.0) for stage in WAIT_STAGES}


def where_the_time_went(summed: Mapping[str, float]) -> str:
    """The largest stage and its share of the wall clock, then the others, e.g. 'generate 61% of
    3m12s, train 22%, eval 9%, driver 6%, score 2%' ('' without figures)."""
    wall = summed.get("wall_s", 0.0)
    if wall <= 0:
        return ""
    ranked = sorted(waits(summed).items(), key=lambda item: -item[1])
    first, *rest = [f"{stage} {seconds / wall:.0%}" for stage, seconds in ranked if seconds > 0] or ["driver 100%"]
    return ", ".join([f"{first} of {_duration(wall)}", *rest])


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{seconds:.1f}s"
