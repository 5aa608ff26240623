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

X_AXES = {"step": "step", "epoch": "epoch", "seconds": "training time",
          "bytes": "sent by all workers"}
IGNORED_IN_LEGEND = ("name", "config_version")
BANDS = {"ci": "95% CI", "std": "1 std"}  # what a group's shaded band shows
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")  # one per line, in the legend's order


@dataclass
class Line:
    label: str
    x: np.ndarray
    y: np.ndarray
    std: np.ndarray | None = None  # a group's sample standard deviation at each x
    low: np.ndarray | None = None  # a group's band at each x (NaN where one run has data)
    high: np.ndarray | None = None


def run_lines(store: Results, runs: list[RunRecord], metric: str, x_axis: str) -> list[Line]:
    """One line per run that recorded `metric`, labelled by its experiment's name (and what
    differs between runs of the same experiment), marked where its times overran its model."""
    xy = _series(store, runs, metric, x_axis)
    labels = legend_labels(runs)
    return [Line(labels[run.id] + (OVERRAN_MARK if run.timing == "overran" else ""), *xy[run.id])
            for run in runs if run.id in xy]


# A legend's mark on a run whose modeled times are partly this machine's (`RunRecord.timing`).
OVERRAN_MARK = " (timing overran)"


def group_lines(store: Results, runs: list[RunRecord], keys: list[str], metric: str,
                x_axis: str, band: str = "ci") -> list[Line]:
    """One line per group of runs with equal values of `keys`: the mean of the runs' curves,
    each interpolated at every x any of them recorded (only where it has data on both sides),
    their sample standard deviation where at least two runs have data, and a band around the
    mean: the 95% Student-t interval of the mean (`band="ci"`) or ±1 std (`"std"`)."""
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
        low = high = None
        if std is not None:
            std = np.where(present > 1, std, np.nan)
            half = std if band == "std" else _t_quantiles(present) * std / np.sqrt(present)
            low, high = mean - half, mean + half
        label = ", ".join(f"{_short(k)}={v}" for k, v in zip(keys, values))
        shown = f"mean ± {BANDS[band]}, {len(members)} runs" if len(members) > 1 else "1 run"
        overran = sum(run.timing == "overran" for run in members)
        shown += f", {overran} with timing overran" if overran else ""
        lines.append(Line(f"{label} ({shown})", grid, mean, std, low, high))
    return lines


def coincident(lines: list[Line]) -> dict[int, int]:
    """Which lines would be drawn exactly over an earlier one (flat and hierarchical
    all-reduce against bytes: the same sums, the same bytes): line index → the index of the
    first earlier line with the same points, to within a thousandth of the y range drawn.
    Those are drawn dashed, their markers between the other's, and the legend and a note
    say so (`coincidence_notes`)."""
    values = [line.y[np.isfinite(line.y)] for line in lines]
    finite = [v for v in values if len(v)]
    span = float(np.ptp(np.concatenate(finite))) if finite else 0.0
    tolerance = max(span, 1e-12) * 1e-3
    same: dict[int, int] = {}
    for index, line in enumerate(lines):
        for earlier in range(index):
            other = lines[earlier]
            if (len(line.x) and len(line.x) == len(other.x)
                    and np.allclose(line.x, other.x, rtol=1e-9, atol=0)
                    and np.allclose(line.y, other.y, rtol=0, atol=tolerance, equal_nan=True)):
                same[index] = same.get(earlier, earlier)
                break
    return same


def coincidence_notes(lines: list[Line], terminal: bool = False) -> list[str]:
    """One line per line drawn over an earlier one: what `dsgd plot` prints beside its chart
    (in the terminal, each line's own marker character tells them apart)."""
    how = ("with its own marker over the other's" if terminal
           else "dashed, with hollow markers between the other's")
    return [f"note: {lines[index].label!r} has the same curve as {lines[earlier].label!r}: "
            f"drawn {how}" for index, earlier in coincident(lines).items()]


def _t_quantiles(counts: np.ndarray) -> np.ndarray:
    """Student's t at 97.5% for each count of runs (n − 1 degrees of freedom); NaN below 2."""
    from scipy.stats import t

    return np.where(counts > 1, t.ppf(0.975, np.maximum(counts - 1, 1)), np.nan)


def legend_labels(runs: list[RunRecord]) -> dict[int, str]:
    """For each run, its experiment's name; where several runs share it, the name with what
    differs between them (`allreduce: seed=1`), or the run id where nothing does."""
    by_name: dict[str, list[RunRecord]] = {}
    for run in runs:
        by_name.setdefault(run.experiment, []).append(run)
    labels = {}
    for name, same in by_name.items():
        if len({run.id for run in same}) == 1:
            labels.update({run.id: name for run in same})
        else:
            labels.update({run_id: f"{name}: {text}" for run_id, text in differences(same).items()})
    return labels


def differences(runs: list[RunRecord]) -> dict[int, str]:
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


def figure(lines: list[Line], metric: str, x_axis: str, clock: str | None = None,
           grouped_by: list[str] | None = None):
    """A matplotlib figure of the lines, without a display (for files and for tests): a title
    saying what is drawn against what (and by what it is grouped), axes with their units and
    clock, each line with its own marker, and the legend beside the data, never over it."""
    Figure = _figure_class()
    fig = Figure(figsize=(9, 5), layout="constrained")
    ax = fig.add_subplot()
    scale, unit = _byte_scale(lines) if x_axis == "bytes" else (1.0, "")
    same = coincident(lines)
    for index, line in enumerate(lines):
        x = line.x / scale
        every = max(1, len(x) // 12)
        style: dict = {"marker": MARKERS[index % len(MARKERS)], "markersize": 4,
                       "markevery": every, "label": line.label}
        if index in same:  # over an earlier line: dashed, hollow markers between its markers
            style.update(linestyle=(0, (4, 3)), markersize=7, markerfacecolor="none",
                         markevery=(every // 2, every) if every > 1 else every,
                         label=f"{line.label} (same curve as {lines[same[index]].label})")
        (drawn,) = ax.plot(x, line.y, **style)
        if line.low is not None:
            ax.fill_between(x, line.low, line.high, color=drawn.get_color(), alpha=0.2, linewidth=0)
    x_label = x_axis_label(x_axis, clock, unit)
    ax.set_xlabel(x_label)
    ax.set_ylabel(_metric_label(metric, clock))
    title = f"{metric} against {x_label}"
    ax.set_title(title + (f", by {', '.join(_short(k) for k in grouped_by)}" if grouped_by else ""),
                 fontsize="medium")
    ax.grid(alpha=0.3)
    if lines:
        fig.legend(loc="outside right upper", fontsize="small")
    return fig


def x_axis_label(x_axis: str, clock: str | None, unit: str = "") -> str:
    """`modeled seconds`, `MB sent by all workers`, `step`: the axis with its unit and clock."""
    if x_axis == "seconds":
        return {"modeled": "modeled seconds", "measured": "measured seconds",
                "mixed": "seconds (modeled and measured: not comparable)"}.get(clock or "", "seconds")
    if x_axis == "bytes":
        return f"{unit} {X_AXES['bytes']}"
    return X_AXES[x_axis]


def _byte_scale(lines: list[Line]) -> tuple[float, str]:
    """The unit bytes are drawn in, by the largest value: kB below 1 MB, GB from 10 GB on, MB
    between (powers of 1000, as tables show them)."""
    largest = max((float(np.nanmax(line.x)) for line in lines if len(line.x)), default=0.0)
    if largest < 1e6:
        return 1e3, "kB"
    return (1e9, "GB") if largest >= 1e10 else (1e6, "MB")


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
                   color: bool, clock: str | None = None) -> str:
    """The same chart as text, drawn by plotext (group means only: no shaded bands)."""
    import plotext

    plotext.clear_figure()
    plotext.plotsize(width, height)
    same = coincident(lines)
    for index, line in enumerate(lines):
        label = line.label + (f" (same curve as {lines[same[index]].label})" if index in same
                              else "")
        plotext.plot(line.x.tolist(), line.y.tolist(), label=label,
                     marker=TERMINAL_MARKERS[index % len(TERMINAL_MARKERS)])
    plotext.xlabel(x_axis_label(x_axis, clock, "bytes"))
    plotext.ylabel(_metric_label(metric, clock))
    chart = plotext.build()
    return chart if color else plotext.uncolorize(chart)


def _metric_label(metric: str, clock: str | None = None) -> str:
    if metric.endswith("seconds") or metric.startswith("time_to_"):
        return f"{metric} ({clock} s)" if clock in ("modeled", "measured") else f"{metric} (s)"
    if metric.startswith("bytes") or metric.endswith("bytes_sent"):
        return f"{metric} (bytes)"
    return metric
