"""This module sends a run's metrics rows to the experiment trackers it names (`--report-to`): one
small adapter per tracker behind `tracking.Tracker`, all fed the same rows by `Trackers.log`.

Every tracker gets the numbers of each metrics.jsonl row under the same keys, at step = the row's
iteration, and the run's config (`RunConfig.flat`) as its config or params. A resumed or retried
driver continues the same tracker run where the library allows it (the tracking id in the loop's
checkpoint names it); it logs only iterations after the checkpoint, so no step is logged twice:

- wandb: the run with id = the tracking id, `resume="allow"`.
- trackio: the run named by the tracking id in its project, `resume="allow"`; trackio's own
  TRACKIO_DIR (default ~/.cache/huggingface/trackio), TRACKIO_SPACE_ID or TRACKIO_SERVER_URL say
  where it goes.
- mlflow: the run tagged `grpo_flyte.tracking_id` in the experiment (MLFLOW_EXPERIMENT_NAME, else
  --tracking-project), found again on resume; its params stay as the run started (MLflow's params
  cannot change). MLFLOW_TRACKING_URI says where; without it a local run keeps a file store in
  <run-dir>/mlruns (mlflow-skinny has no SQLite store), where a key's '/' is written '.'.
- tensorboard: event files in <run-dir>/tensorboard, a new file per attempt, which TensorBoard
  reads as one run. A local run's only: a cluster driver's files are lost with its pod.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import time
import urllib.parse
from pathlib import Path
from typing import Any

from grpo_flyte.config.run import RunConfig
from grpo_flyte.errors import ConfigError
from grpo_flyte.reporting.tracking import (
    ANSWER_COLUMNS,
    COMPLETION_COLUMNS,
    Table,
    Tracker,
    WandbRun,
    metric_values,
    missing_package,
    wandb_project_of,
)

logger = logging.getLogger("grpo_flyte")

MLFLOW_TAG = "grpo_flyte.tracking_id"  # the MLflow run tag that finds a resumed run's MLflow run
MLFLOW_DIR = "mlruns"  # a local run's MLflow file store, without MLFLOW_TRACKING_URI
TENSORBOARD_DIR = "tensorboard"  # a local run's TensorBoard event files
# MLflow's limits per log_batch call (params, metrics) and on a param's value.
_MLFLOW_PARAMS, _MLFLOW_METRICS, _MLFLOW_VALUE_CHARS = 100, 1000, 6000


class WandbTracker:
    """A W&B run. WANDB_MODE, WANDB_ENTITY and WANDB_API_KEY are read by wandb itself;
    WANDB_MODE=offline writes the run under WANDB_DIR (a local run's folder) for `wandb sync`.
    A cluster sweep's config names its run and groups it under the sweep (`name`, `group`)."""

    def __init__(
        self, project: str, run_id: str, config: dict[str, Any], entity: str | None, name: str | None = None, group: str | None = None
    ):
        import wandb

        # entity None: WANDB_ENTITY, else the key's default entity; name and group None: wandb's own (a
        # generated name, no group)
        self._run = wandb.init(project=project, entity=entity, id=run_id, resume="allow", config=config, name=name, group=group)
        logger.info("logging metrics to W&B project %s, run %s", project, run_id)

    def log(self, step: int, values: dict[str, float], tables: dict[str, Table]) -> None:
        import wandb

        logged: dict[str, Any] = dict(values)
        logged.update({name: wandb.Table(columns=list(t.columns), data=t.rows) for name, t in tables.items()})
        self._run.log(logged, step=step)

    def finish(self, failed: bool) -> None:
        self._run.finish(exit_code=1 if failed else 0)


class TrackioTracker:
    """A trackio run, named by the tracking id. trackio prints a banner on init and finish: it goes
    to the log at debug level, so the console keeps the run's own lines."""

    def __init__(self, project: str, run_id: str, config: dict[str, Any]):
        import trackio

        with _quiet():
            # the driver's CPU and GPU are not the train step's on a cluster: the run logs our rows only
            self._run = trackio.init(
                project=project, name=run_id, config=config, resume="allow", embed=False, auto_log_cpu=False, auto_log_gpu=False
            )
        logger.info("logging metrics to trackio project %s, run %s", project, run_id)

    def log(self, step: int, values: dict[str, float], tables: dict[str, Table]) -> None:
        import trackio

        logged: dict[str, Any] = dict(values)
        logged.update({name: trackio.Table(columns=list(t.columns), data=t.rows) for name, t in tables.items()})
        self._run.log(logged, step=step)

    def finish(self, failed: bool) -> None:
        with _quiet():
            self._run.finish()


class MlflowTracker:
    """An MLflow run, through the client API (a local sweep's runs share this process, and the
    fluent API's active run is one per process). Tables are JSON artifacts `<name>/iter-NNNN.json`."""

    def __init__(self, experiment: str, run_id: str, run_name: str, config: dict[str, Any], folder: Path | None):
        import mlflow
        from mlflow.entities import Param

        uri = None
        if not os.environ.get("MLFLOW_TRACKING_URI") and folder is not None:
            # MLflow 3 refuses its file store (in maintenance) unless asked; mlflow-skinny has no other local store
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (folder / MLFLOW_DIR).as_uri()
        self._client = client = mlflow.MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or experiment
        found = client.get_experiment_by_name(name)
        experiment_id = found.experiment_id if found is not None else client.create_experiment(name)
        runs = client.search_runs([experiment_id], f"tags.`{MLFLOW_TAG}` = '{run_id}'", max_results=1)
        if runs:
            self._id, logged = runs[0].info.run_id, set(runs[0].data.params)
            client.update_run(self._id, status="RUNNING")
        else:
            self._id, logged = client.create_run(experiment_id, run_name=run_name, tags={MLFLOW_TAG: run_id}).info.run_id, set()
        params = [Param(k, str(v)[:_MLFLOW_VALUE_CHARS]) for k, v in config.items() if k not in logged]
        for i in range(0, len(params), _MLFLOW_PARAMS):
            client.log_batch(self._id, params=params[i : i + _MLFLOW_PARAMS])
        # The file store keeps a metric in a file named by its key: eval_reward beside eval_reward/correct
        # would need a file and a folder of one name, so there '/' is written '.' (eval_reward.correct).
        self._slash = "." if urllib.parse.urlparse(client.tracking_uri).scheme in ("", "file") else "/"
        logger.info("logging metrics to MLflow experiment %s, run %s (%s)", name, self._id, client.tracking_uri)

    def log(self, step: int, values: dict[str, float], tables: dict[str, Table]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key.replace("/", self._slash), float(value), now, step) for key, value in values.items()]
        for i in range(0, len(metrics), _MLFLOW_METRICS):
            self._client.log_batch(self._id, metrics=metrics[i : i + _MLFLOW_METRICS])
        for name, t in tables.items():
            columns = {c: [row[j] for row in t.rows] for j, c in enumerate(t.columns)}
            self._client.log_table(self._id, columns, f"{name}/iter-{step:04d}.json")

    def finish(self, failed: bool) -> None:
        self._client.set_terminated(self._id, "FAILED" if failed else "FINISHED")


class TensorboardTracker:
    """TensorBoard event files in <run-dir>/tensorboard, written with tensorboard's own writer (no
    TensorFlow, no torch). Scalars only: TensorBoard has no table type."""

    def __init__(self, folder: Path | None):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        if folder is None:
            raise ConfigError(
                "tensorboard writes under the local run folder, and this run has none (a cluster driver's files are lost "
                "with its pod); expected a local run, or wandb, mlflow with MLFLOW_TRACKING_URI, or trackio with a Space",
                field="report_to",
            )
        self._writer = EventFileWriter(str(folder / TENSORBOARD_DIR))
        logger.info("logging metrics to TensorBoard: tensorboard --logdir %s", folder / TENSORBOARD_DIR)

    def log(self, step: int, values: dict[str, float], tables: dict[str, Table]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=key, simple_value=float(value)) for key, value in values.items()])
        self._writer.add_event(Event(wall_time=time.time(), step=step, summary=summary))
        self._writer.flush()

    def finish(self, failed: bool) -> None:
        self._writer.close()


@contextlib.contextmanager
def _quiet():
    """A library's prints, to the log at debug level."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            yield
    finally:
        if out.getvalue().strip():
            logger.debug("%s", out.getvalue().strip())


def open_tracker(name: str, config: RunConfig, run_id: str, folder: Path | None, chosen: WandbRun | None) -> Tracker:
    """The run of tracker `name` for a train_rl run: `run_id` is the loop's tracking id, `folder`
    the local run folder (None on a cluster), `chosen` the W&B run a cluster submitter chose."""
    params = json.loads(json.dumps(config.flat(), default=str))  # plain JSON values: tuples, paths
    try:
        if name == "wandb":
            if chosen is None:
                return WandbTracker(wandb_project_of(config.wandb_project, config.tracking_project), run_id, params, None)
            return WandbTracker(chosen.project, run_id, params, chosen.entity, chosen.name, chosen.group)
        if name == "trackio":
            return TrackioTracker(config.tracking_project, run_id, params)
        if name == "mlflow":
            return MlflowTracker(config.tracking_project, run_id, folder.name if folder else run_id, params, folder)
        if name == "tensorboard":
            return TensorboardTracker(folder)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == name:
            raise ConfigError(missing_package(name), field="report_to") from None
        raise
    raise ConfigError(f"{name!r}: not a tracker", field="report_to")


class Trackers:
    """The trackers a train_rl run logs to (`RunConfig.trackers`), each told the same rows."""

    def __init__(self, config: RunConfig, run_id: str, folder: Path | None = None, chosen: WandbRun | None = None):
        self._open: list[Tracker] = []
        try:
            for name in config.trackers:
                self._open.append(open_tracker(name, config, run_id, folder, chosen))
        except BaseException:
            self.finish(failed=True)
            raise

    def log(
        self, row: dict[str, Any], answers: list[dict[str, Any]] | None = None, completions: list[dict[str, Any]] | None = None
    ) -> None:
        """One metrics row (`MetricsRow.flat`); with a held-out evaluation's answers, also a table of
        them (`held_out_answers`), and with --log-completions the iteration's sample (`completions`),
        at the same step."""
        tables = {}
        if answers:
            tables["held_out_answers"] = Table.of(ANSWER_COLUMNS, answers)
        if completions:
            tables["completions"] = Table.of(COMPLETION_COLUMNS, completions)
        values = metric_values(row)
        for tracker in self._open:
            tracker.log(int(row["iteration"]), values, tables)

    def finish(self, failed: bool = False) -> None:
        opened, self._open = self._open, []
        for tracker in opened:
            tracker.finish(failed)
