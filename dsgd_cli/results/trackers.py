"""`dsgd export --format tensorboard|mlflow`: recorded runs sent to the trackers researchers
already use. TensorBoard gets event files, a directory per run; MLflow gets a run per dsgd run
at a tracking URI. Each needs an optional extra (`dsgd[tensorboard]`, `dsgd[mlflow]`), imported
only here and only when asked for."""

from __future__ import annotations

import itertools
import json
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, NamedTuple

import yaml

from dsgd_cli.errors import DsgdError, Interrupted
from dsgd_cli.results.reader import flatten_config
from dsgd_cli.spec.directories import refuse_shared, refuse_untrusted

if TYPE_CHECKING:
    from dsgd_cli.results.reader import RunRecord

# What an ended dsgd run's status is called by each tracker; a run still running is left open.
MLFLOW_STATUS = {"completed": "FINISHED", "failed": "FAILED", "diverged": "FAILED",
                 "interrupted": "KILLED"}
# The hparams plugin knows no `aborted`: an interrupted run is STATUS_UNKNOWN (dsgd.status says).
TENSORBOARD_STATUS = {"completed": "STATUS_SUCCESS", "failed": "STATUS_FAILURE",
                      "diverged": "STATUS_FAILURE", "running": "STATUS_RUNNING"}
DEFAULT_MLFLOW_EXPERIMENT = "dsgd"
RUN_DIRECTORY = "--output: the run's directory"  # what a TensorBoard run's directory is called


class Value(NamedTuple):
    """One recorded metric value, as `export` reads it."""

    metric: str
    step: int | None
    epoch: int | None
    rank: int | None
    seconds: float | None
    value: float

    @property
    def tag(self) -> str:
        """The tracker's name for it: a per-rank value as NAME/rank_R."""
        return self.metric if self.rank is None else f"{self.metric}/rank_{self.rank}"


def write(fmt: str, target: str, runs: list[RunRecord], rows: Iterable[list]) -> Iterator[str]:
    """Send `runs` with their metric `rows` (export's rows, ordered by run id, each ending in
    metric, step, epoch, rank, seconds, value) to the tracker of `fmt` at `target`, a run at a
    time; yields a line to tell the user after each."""
    histories = _histories(runs, rows)
    if fmt == "tensorboard":
        return _write_tensorboard(Path(target), runs, histories)
    return _write_mlflow(target, histories)


def _histories(runs: list[RunRecord], rows: Iterable[list]
               ) -> Iterator[tuple[RunRecord, list[Value]]]:
    """Each run with its values, one run's values in memory at a time."""
    grouped = itertools.groupby(rows, key=lambda row: row[0])
    pending = next(grouped, None)
    for run in sorted(runs, key=lambda run: run.id):
        values = []
        if pending is not None and pending[0] == run.id:
            values = [Value(*row[-6:]) for row in pending[1]]
            pending = next(grouped, None)
        yield run, values


def missing_package(fmt: str) -> DsgdError:
    return DsgdError(f"--format {fmt} needs the {fmt} package: pip install 'dsgd[{fmt}]'")


def run_params(run: RunRecord) -> dict[str, str | int | float]:
    """The run's configuration by flattened dotted key (`optimizer.lr`): numbers stay
    numbers, text stays text, anything else (booleans, lists, null) becomes its JSON text."""
    params: dict[str, str | int | float] = {}
    for key, value in flatten_config(run.config).items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            params[key] = value
        else:
            params[key] = value if isinstance(value, str) else json.dumps(value)
    return params


def _start_seconds(run: RunRecord) -> float:
    return run.started_at.timestamp()


def _wall_time(run: RunRecord, value: Value) -> float:
    """When the value was recorded, in seconds since the epoch: the run's start plus the
    value's `seconds` (on the run's clock: modeled seconds for an emulated cluster)."""
    return _start_seconds(run) + (value.seconds or 0.0)


# -- TensorBoard ---------------------------------------------------------------------------------

def run_directory_name(run: RunRecord) -> str:
    """run-ID-EXPERIMENT, with what a file name cannot hold (a slash, spaces) as _."""
    return f"run-{run.id}-" + re.sub(r"[^\w.,=+\-\[\]]", "_", run.experiment)


def _write_tensorboard(directory: Path, runs: list[RunRecord], histories) -> Iterator[str]:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch's writer needs the tensorboard package
        raise missing_package("tensorboard") from None
    if directory.exists() and not directory.is_dir():
        raise DsgdError(f"--output {directory}: not a directory (--format tensorboard writes "
                        "a directory per run in it)")
    for run_dir in (directory / run_directory_name(run) for run in runs):
        if os.path.lexists(run_dir):  # refused before any run is written
            refuse_untrusted(run_dir, RUN_DIRECTORY)
    for run, values in histories:
        run_dir = directory / run_directory_name(run)
        try:
            _make_run_directory(run_dir)
        except OSError as error:
            raise DsgdError(f"--output {directory}: {error.strerror}") from None
        if any(run_dir.glob("events.out.tfevents.*")):
            yield f"skipped run {run.id}: {run_dir} already has event files"
            continue
        try:
            writer = SummaryWriter(log_dir=str(run_dir))
        except OSError as error:
            raise DsgdError(f"--output {directory}: {error.strerror}") from None
        with writer:
            _write_tensorboard_run(writer, run, values)
        yield f"wrote {run_dir}"


def _make_run_directory(run_dir: Path) -> None:
    """Make a run's directory in the export's, or take the one already there, as `save_dir`'s
    experiment directories are: refused (UntrustedDirectory) when the export's directory lets
    other users swap what is in it, or the run's directory is a link or another user's (the
    event files would go wherever it points)."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    refuse_shared(run_dir.parent, "--output")
    try:
        os.mkdir(run_dir)
    except FileExistsError:
        pass  # an earlier export's, or planted: `refuse_untrusted` tells
    refuse_untrusted(run_dir, RUN_DIRECTORY)


def _write_tensorboard_run(writer, run: RunRecord, values: list[Value]) -> None:
    """Every value a scalar at its step (a whole-run value, which has none, at step 0), the
    configuration as text and as hparams, with the whole-run values as the hparams metrics."""
    for value in values:
        writer.add_scalar(value.tag, value.value, global_step=value.step or 0,
                          walltime=_wall_time(run, value))
    start = _start_seconds(run)
    writer.add_text("config", _config_markdown(run), global_step=0, walltime=start)
    whole_run = sorted({value.tag for value in values if value.step is None})
    hparams = {**run_params(run), "dsgd.run_id": run.id, "dsgd.experiment": run.experiment,
               "dsgd.clock": run.clock, "dsgd.status": run.status,
               "dsgd.tags": ",".join(run.tag_names)}
    for summary in _hparams_summaries(hparams, whole_run, run.status):
        writer.file_writer.add_summary(summary, 0, start)


def _config_markdown(run: RunRecord) -> str:
    """The run's identity and configuration as YAML in a Markdown code block (TensorBoard's
    text dashboard renders Markdown)."""
    header = {"run_id": run.id, "experiment": run.experiment, "status": run.status,
              "clock": run.clock, "tags": run.tag_names}
    text = yaml.safe_dump(header, sort_keys=False) + yaml.safe_dump(run.config, sort_keys=False)
    return "\n".join("    " + line for line in text.splitlines())


def _hparams_summaries(hparams: dict, metric_tags: list[str], status: str) -> list:
    """The hparams plugin's experiment, session start and session end, the end with the
    run's status (torch's `hparams` always says success)."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2
    from torch.utils.tensorboard.summary import hparams as hparams_summaries

    experiment, session_start, _ = hparams_summaries(hparams, dict.fromkeys(metric_tags, 0.0))
    status_name = TENSORBOARD_STATUS.get(status, "STATUS_UNKNOWN")
    end = plugin_data_pb2.SessionEndInfo(status=api_pb2.Status.Value(status_name))
    content = plugin_data_pb2.HParamsPluginData(session_end_info=end,
                                                version=metadata.PLUGIN_DATA_VERSION)
    plugin = SummaryMetadata.PluginData(plugin_name=metadata.PLUGIN_NAME,
                                        content=content.SerializeToString())
    session_end = Summary(value=[Summary.Value(tag=metadata.SESSION_END_INFO_TAG,
                                               metadata=SummaryMetadata(plugin_data=plugin))])
    return [experiment, session_start, session_end]


# -- MLflow --------------------------------------------------------------------------------------

def _write_mlflow(uri: str, histories) -> Iterator[str]:
    try:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise missing_package("mlflow") from None
    try:
        with _file_store_allowed(uri):
            client = MlflowClient(tracking_uri=uri)
            experiment_id = _mlflow_experiment(client)
            for run, values in histories:
                if _already_exported(client, experiment_id, run):
                    yield f"skipped run {run.id}: already in {uri}"
                    continue
                mlflow_id = _log_mlflow_run(client, experiment_id, run, values)
                yield f"logged run {run.id} to {uri} (MLflow run {mlflow_id})"
    except ModuleNotFoundError as error:  # sqlite:/// needs alembic, which mlflow-skinny lacks
        package = (error.name or "").partition(".")[0]
        raise DsgdError(f"--format mlflow: {uri} needs the {package} package: "
                        "pip install 'dsgd[mlflow]'") from None
    except MlflowException as error:
        interruption = _interruption(error)
        if interruption is not None:
            raise interruption from None
        first_line = str(error.message).strip().splitlines()[0]
        raise DsgdError(f"--output {uri}: {first_line}") from None
    except OSError as error:  # a directory or SQLite file that cannot be made
        raise DsgdError(f"--output {uri}: {error.strerror}: {error.filename}") from None


def _interruption(error: BaseException | None) -> Interrupted | None:
    """The SIGINT or SIGTERM that MLflow's HTTP client caught (it retries a server for
    minutes) and raised again as an error of its own: dsgd exits as interrupted."""
    while error is not None and not isinstance(error, Interrupted):
        error = error.__context__
    return error


def is_file_store(uri: str) -> bool:
    """Whether MLflow reads `uri` as its file store: a local path or a file: URI."""
    return uri.startswith("file:") or not re.match(r"^[A-Za-z][\w+.\-]*://", uri)


@contextmanager
def _file_store_allowed(uri: str) -> Iterator[None]:
    """MLflow 3 keeps its file store (a directory, ./mlruns) in maintenance mode and refuses it
    unless MLFLOW_ALLOW_FILE_STORE is set; a user who names a directory asks for it."""
    if not is_file_store(uri) or "MLFLOW_ALLOW_FILE_STORE" in os.environ:
        yield
        return
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        yield
    finally:
        del os.environ["MLFLOW_ALLOW_FILE_STORE"]


def _mlflow_experiment(client) -> str:
    """The MLflow experiment every run goes to: $MLFLOW_EXPERIMENT_NAME (MLflow's own variable),
    else `dsgd`; made when missing."""
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_MLFLOW_EXPERIMENT
    found = client.get_experiment_by_name(name)
    return found.experiment_id if found is not None else client.create_experiment(name)


def _already_exported(client, experiment_id: str, run: RunRecord) -> bool:
    """Whether this dsgd run (its id and start time) was logged here before."""
    started = run.started_at.isoformat()
    found = client.search_runs([experiment_id], max_results=1,
                               filter_string=f"tags.`dsgd.run_id` = '{run.id}' and "
                                             f"tags.`dsgd.started_at` = '{started}'")
    return bool(found)


# What an MLflow run's times are (`dsgd.times`): its start and end are real, when the dsgd run
# began and ended on its machine; each metric's time is that start plus the value's seconds
# on the run's clock, which for a modeled run is not the time it was recorded.
MLFLOW_TIMES = {
    "modeled": "start and end times are real (when the run began and ended on {host}); "
               "metric times are the start plus modeled seconds of the emulated cluster, "
               "not when they were recorded",
    "measured": "start and end times are real (when the run began and ended on {host}); "
                "metric times are the start plus measured seconds since training began",
}


def run_tags(run: RunRecord) -> dict[str, str]:
    tags = {"dsgd.run_id": str(run.id), "dsgd.experiment": run.experiment,
            "dsgd.clock": run.clock, "dsgd.status": run.status,
            "dsgd.started_at": run.started_at.isoformat(), "dsgd.tags": ",".join(run.tag_names),
            "dsgd.version": run.dsgd_version, "dsgd.host": run.host,
            "dsgd.times": MLFLOW_TIMES[run.clock].format(host=run.host)}
    if run.reason:
        tags["dsgd.reason"] = run.reason
    if run.spec_file:
        tags["mlflow.source.name"] = run.spec_file
    return tags


def _log_mlflow_run(client, experiment_id: str, run: RunRecord, values: list[Value]) -> str:
    from mlflow.entities import Metric, Param
    from mlflow.utils.validation import (MAX_METRICS_PER_BATCH, MAX_PARAM_VAL_LENGTH,
                                         MAX_PARAMS_TAGS_PER_BATCH)

    start_ms = round(_start_seconds(run) * 1000)
    created = client.create_run(experiment_id, start_time=start_ms, tags=run_tags(run),
                                run_name=run.experiment)
    mlflow_id = created.info.run_id
    params = [Param(key, _clip(str(value), MAX_PARAM_VAL_LENGTH))
              for key, value in run_params(run).items()]
    for batch in _batches(params, MAX_PARAMS_TAGS_PER_BATCH):
        client.log_batch(mlflow_id, params=batch)
    metrics = [Metric(value.tag, value.value, round(_wall_time(run, value) * 1000),
                      value.step or 0) for value in values]
    for batch in _batches(metrics, MAX_METRICS_PER_BATCH):
        client.log_batch(mlflow_id, metrics=batch)
    if run.status in MLFLOW_STATUS:
        end_ms = round(run.ended_at.timestamp() * 1000) if run.ended_at else None
        client.set_terminated(mlflow_id, MLFLOW_STATUS[run.status], end_time=end_ms)
    return mlflow_id


def _clip(text: str, limit: int) -> str:
    """`text` cut to MLflow's limit on a parameter value, the cut marked by `...`."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _batches(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start:start + size]
