"""Curves of a metric over steps, epochs, time or bytes: one line per run, or per group of runs
(mean with a ±std band), drawn with matplotlib into a file or with plotext in the terminal."""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from itertools import chain

import numpy as np

from dsgd_cli.results.history import BytesSent, curve_points, load_history
from dsgd_cli.errors import DsgdError
from dsgd_cli.results.query import flat_config, run_value
from dsgd_cli.results.reader import Results, RunRecord

X_AXES = {"step": "step", "epoch": "epoch", "seconds": "training time (s)",
          "bytes": "bytes sent by all workers"}
IGNORED_IN_LEGEND = ("name",)


@dataclass
class Line:
    label: str
    x: np.ndarray
    y: np.ndarray
    std: np.ndarray | None = None  # a group's sample standard deviation at each x


def run_lines(store: Results, runs: list[RunRecord], metric: str, x_axis: str) -> list[Line]:
    """One line per run that recorded `metric`, labelled by what differs between the runs."""
    xy = _series(store, runs, metric, x_axis)
    labels = legend_labels(runs)
    return [Line(labels[run.id], *xy[run.id]) for run in runs if run.id in xy]


def group_lines(store: Results, runs: list[RunRecord], keys: list[str], metric: str,
                x_axis: str) -> list[Line]:
    """One line per group of runs with equal values of `keys`: the mean of the runs' curves,
    each interpolated at every x any of them recorded (only where it has data on both sides),
    and their sample standard deviation where at least two runs have data."""
    xy = _series(store, runs, metric, x_axis)
    groups: dict[tuple, list[RunRecord]] = {}
    for run in runs:
        if run.id in xy:
            groups.setdefault(tuple(_shown(run_value(run, k)) for k in keys), []).append(run)
    lines = []
    for values, members in groups.items():
        grid = np.unique(np.concatenate([xy[run.id][0] for run in members]))
        curves = np.array([np.interp(grid, *xy[run.id], left=np.nan, right=np.nan)
                           for run in members])
        present = (~np.isnan(curves)).sum(axis=0)
        with warnings.catch_warnings():  # a single run at an x has no spread: NaN there
            warnings.simplefilter("ignore", RuntimeWarning)
            mean = np.nanmean(curves, axis=0)
            std = np.nanstd(curves, axis=0, ddof=1) if len(members) > 1 else None
        if std is not None:
            std = np.where(present > 1, std, np.nan)
        label = ", ".join(f"{_short(k)}={v}" for k, v in zip(keys, values))
        lines.append(Line(f"{label} ({len(members)} runs)", grid, mean, std))
    return lines


def legend_labels(runs: list[RunRecord]) -> dict[int, str]:
    """For each run, the configuration keys whose values differ between `runs` (`lr=0.1,
    aggregator=sgp`), leaving out options that differ only because the plugin does; the run
    id where nothing differs or two runs would look the same."""
    configs = {run.id: flat_config(run) for run in runs}
    keys = [k for k in dict.fromkeys(k for config in configs.values() for k in config)
            if k not in IGNORED_IN_LEGEND]  # in the configuration's order

    def differs(key: str, among: list[dict]) -> bool:
        return len({repr(config.get(key)) for config in among}) > 1

    def shown(key: str) -> bool:
        if not differs(key, list(configs.values())):
            return False
        section = key.rsplit(".", 1)[0] if "." in key else None
        plugin = f"{section}.name" if section else None
        if plugin in keys and plugin != key:  # an option: does it differ for one plugin?
            by_plugin: dict[str, list[dict]] = {}
            for config in configs.values():
                by_plugin.setdefault(repr(config.get(plugin)), []).append(config)
            return any(differs(key, same) for same in by_plugin.values())
        return True

    differing = [k for k in keys if shown(k)]
    labels = {run.id: ", ".join(f"{_short(k)}={configs[run.id][k]}" for k in differing
                                if configs[run.id].get(k) is not None)
              for run in runs}
    repeated = {label for label in labels.values() if list(labels.values()).count(label) > 1}
    return {run_id: (f"run {run_id}" + (f": {label}" if label else "")
                     if not label or label in repeated else label)
            for run_id, label in labels.items()}


def _short(key: str) -> str:
    """`aggregator.name` → `aggregator`: a plugin's name is what the reader knows it by."""
    return key[: -len(".name")] if key.endswith(".name") else key


def _shown(value) -> object:
    return ",".join(sorted(value)) if isinstance(value, set) else value


def _series(store: Results, runs: list[RunRecord], metric: str,
            x_axis: str) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Each run's points of `metric` (`curve_points`), as x and y arrays sorted by x (then
    y); runs without a point left out."""
    if x_axis not in X_AXES:
        raise DsgdError(f"--x: expected one of {', '.join(X_AXES)}, got {x_axis!r}")
    ids = [run.id for run in runs]
    # x by step: the bytes axis is worked out from each run's bytes_sent records below.
    column = "step" if x_axis == "bytes" else x_axis
    with store.connect() as connection:
        # Hundreds of thousands of plain numbers: the driver's rows straight into an array.
        rows = connection.execute(curve_points(ids, metric, column)).cursor.fetchall()
    table = np.fromiter(chain.from_iterable(rows), dtype=float,
                        count=3 * len(rows)).reshape(len(rows), 3)
    run_ids, xs, ys = table[:, 0], table[:, 1], table[:, 2]
    if x_axis == "bytes":
        sent = load_history(store, ids, ["bytes_sent"])
        bytes_sent = {run_id: BytesSent(sent.get((run_id, "bytes_sent"), [])) for run_id in ids}
        xs = np.array([bytes_sent[int(run_id)].by_step(int(step))
                       for run_id, step in zip(run_ids, xs)], dtype=float)
    order = np.lexsort((ys, xs, run_ids))  # by run, then x, then y
    run_ids, xs, ys = run_ids[order], xs[order], ys[order]
    starts = np.flatnonzero(np.diff(run_ids, prepend=np.nan))  # each run's first point
    ends = np.append(starts[1:], len(run_ids))
    series = {int(run_ids[start]): (xs[start:end], ys[start:end])
              for start, end in zip(starts, ends)}
    if not series:
        raise DsgdError(f"--metric: none of the {len(runs)} selected runs recorded "
                        f"{metric!r} with a {x_axis}")
    return series


def figure(lines: list[Line], metric: str, x_axis: str):
    """A matplotlib figure of the lines, without a display (for files and for tests)."""
    Figure = _figure_class()
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.add_subplot()
    for line in lines:
        (drawn,) = ax.plot(line.x, line.y, label=line.label, marker="o" if len(line.x) < 20 else None)
        if line.std is not None:
            ax.fill_between(line.x, line.y - line.std, line.y + line.std,
                            color=drawn.get_color(), alpha=0.2, linewidth=0)
    ax.set_xlabel(X_AXES[x_axis])
    ax.set_ylabel(_metric_label(metric))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def _figure_class():
    """matplotlib's Figure (no pyplot: no GUI backend, no global state) and the Agg canvas
    that writes its files. Imported for the first time here, matplotlib skips the table of
    settable properties it writes into each artist class's `set` docstring (and into the
    docstrings that quote them): a third of its import time, seen only by `help()`."""
    if "matplotlib.figure" not in sys.modules:
        import matplotlib.artist

        kwdoc = getattr(matplotlib.artist, "kwdoc", None)
        if kwdoc is not None:
            matplotlib.artist.kwdoc = lambda artist: ""
        try:
            import matplotlib.backends.backend_agg  # noqa: F401  (what savefig uses for files)
            import matplotlib.figure  # noqa: F401
        finally:
            if kwdoc is not None:
                matplotlib.artist.kwdoc = kwdoc
    from matplotlib.figure import Figure

    return Figure


TERMINAL_MARKERS = ("braille", "x", "+", "o", "*", "dot")  # tell lines apart without color


def terminal_chart(lines: list[Line], metric: str, x_axis: str, width: int, height: int,
                   color: bool) -> str:
    """The same chart as text, drawn by plotext (group means only: no shaded bands)."""
    import plotext

    plotext.clear_figure()
    plotext.plotsize(width, height)
    for index, line in enumerate(lines):
        plotext.plot(line.x.tolist(), line.y.tolist(), label=line.label,
                     marker=TERMINAL_MARKERS[index % len(TERMINAL_MARKERS)])
    plotext.xlabel(X_AXES[x_axis])
    plotext.ylabel(_metric_label(metric))
    chart = plotext.build()
    return chart if color else plotext.uncolorize(chart)


def _metric_label(metric: str) -> str:
    if metric.endswith("seconds"):
        return f"{metric} (s)"
    if metric.startswith("bytes") or metric.endswith("bytes_sent"):
        return f"{metric} (bytes)"
    return metric
