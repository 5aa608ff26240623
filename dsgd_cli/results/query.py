"""Selecting runs: `--where KEY OP VALUE` conditions on a run's columns, tags and any key of its
configuration, shared by `compare`, `plot` and `export`."""

from __future__ import annotations

import json
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable
from weakref import WeakKeyDictionary

from dsgd_cli.errors import DsgdError
from dsgd_cli.results.reader import RunRecord, flatten_config

# Keys that name a column of the run rather than a configuration key.
RUN_COLUMNS = ("id", "experiment", "status", "task", "aggregator", "compressor", "optimizer",
               "workers", "host", "tag", "clock", "timing")
OPERATORS: dict[str, Callable[[Any, Any], bool]] = {
    ">=": operator.ge, "<=": operator.le, "!=": operator.ne,
    "=": operator.eq, ">": operator.gt, "<": operator.lt,
}
_CONDITION = re.compile(r"^\s*([A-Za-z_][\w.\-]*)\s*(>=|<=|!=|==|=|>|<)\s*(.*?)\s*$")


@dataclass(frozen=True)
class Condition:
    key: str
    op: str
    value: Any

    def __str__(self) -> str:
        return f"{self.key}{self.op}{self.value}"

    def matches(self, run: RunRecord) -> bool:
        if self.key == "tag":
            tags = run_value(run, "tag")
            return (self.value in tags) == (self.op == "=")
        actual = run_value(run, self.key)
        if actual is None:
            return self.op == "!="
        if self.op in ("=", "!="):
            return OPERATORS[self.op](_comparable(actual), _comparable(self.value))
        if not (_is_number(actual) and _is_number(self.value)):
            return False  # an order on words or on a missing number selects nothing
        return OPERATORS[self.op](actual, self.value)


def parse_where(expression: str) -> Condition:
    """`optimizer.lr<0.1`, `aggregator=sgp`, `tag!=bad` → a Condition (exit 2 if malformed)."""
    match = _CONDITION.match(expression)
    if not match or match.group(3) == "":
        raise DsgdError(f"--where {expression!r}: expected KEY OP VALUE with OP one of "
                        f"{', '.join(OPERATORS)} (e.g. workers>=4)")
    key, op, text = match.groups()
    op = "=" if op == "==" else op
    if text[0] in "<>=!":  # `workers>>2`, `workers=>2`: not an operator this knows
        raise DsgdError(f"--where {expression!r}: expected KEY OP VALUE with one OP, one of "
                        f"{', '.join(OPERATORS)}, got {op!r} followed by {text[0]!r}")
    if op in ("<", "<=", ">", ">=") and key != "tag" and not _is_number(parse_value(text)):
        raise DsgdError(f"--where {expression!r}: {op} compares numbers: expected a number "
                        f"after {op!r}, got {text!r}")
    if key == "tag":  # a tag is text, whatever it looks like (`tag=4`, `tag=true`)
        if op not in ("=", "!="):
            raise DsgdError(f"--where {expression!r}: a tag can only be compared with = or !=")
        return Condition(key, op, text)
    return Condition(key, op, parse_value(text))


def parse_value(text: str) -> Any:
    """`4` → 4, `0.1` → 0.1, `1e-3` → 0.001, `true` → True, anything else the text itself."""
    if text in ("true", "false"):
        return text == "true"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def run_value(run: RunRecord, key: str) -> Any:
    """A run's value for `key`: a column, `tag` (its set of tags), or a dotted configuration
    key (`optimizer.lr`, `aggregator.compressor.ratio`); None when the run has none."""
    if key == "tag":
        return set(run.tag_names)
    if key in RUN_COLUMNS:
        return getattr(run, key)
    return flat_config(run).get(key)


def flat_config(run: RunRecord) -> dict[str, Any]:
    """The run's configuration by dotted key (read, not to be changed): worked out once per
    run, as every condition, key check and label asks for it again."""
    flat = _FLAT_CONFIGS.get(run)
    if flat is None:
        flat = _FLAT_CONFIGS[run] = flatten_config(run.config)
    return flat


_FLAT_CONFIGS: WeakKeyDictionary[RunRecord, dict[str, Any]] = WeakKeyDictionary()


def known_keys(runs: list[RunRecord]) -> set[str]:
    keys = set(RUN_COLUMNS)
    for run in runs:
        keys.update(flat_config(run))
    return keys


def check_keys(keys: list[str], runs: list[RunRecord], option: str) -> None:
    """A key no run has is a typo: say so rather than select nothing."""
    if not runs or not keys:
        return
    known = known_keys(runs)
    for key in keys:
        if key not in known:
            close = sorted(k for k in known if k.split(".")[-1] == key.split(".")[-1])
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise DsgdError(f"{option}: unknown key {key!r}: no recorded run has it{hint}")


def select_runs(runs: list[RunRecord], conditions: list[Condition]) -> list[RunRecord]:
    check_keys([c.key for c in conditions], runs, "--where")
    return [run for run in runs if all(c.matches(run) for c in conditions)]


def pick(runs: list[RunRecord], selectors: list[str]) -> list[RunRecord]:
    """The runs named by `selectors`: run ids, experiment names, or a grid's base name (all
    its points); all runs when there are none. A selector naming nothing is an error."""
    if not selectors:
        return runs
    chosen: set[int] = set()
    for selector in selectors:
        found = {run.id for run in runs if names(run, selector)}
        if not found:
            raise DsgdError(f"{selector!r}: no recorded run has this id or experiment name")
        chosen |= found
    return [run for run in runs if run.id in chosen]


def check_experiment_names(experiments: list[str] | None, selected: list[RunRecord],
                           recorded_names: Callable[[], list[str]]) -> None:
    """An `--experiment` name that selected no run is a typo, as an unknown `--where` key is:
    say so, with the names that are recorded, rather than show an empty table."""
    for name in experiments or []:
        if not any(names(run, name) for run in selected):
            known = sorted(set(recorded_names()))
            shown = ", ".join(known[:20]) + (", ..." if len(known) > 20 else "")
            raise DsgdError(f"--experiment {name!r}: no recorded run has this experiment name "
                            f"(recorded: {shown or 'none'})")


def clocks_note(runs: list[RunRecord]) -> str | None:
    """One line for a comparison or plot whose runs' times are on different clocks (modeled
    on an emulated cluster, measured otherwise): their seconds cannot be set side by side."""
    clocks = {run.clock for run in runs}
    if len(clocks) < 2:
        return None
    modeled = sum(run.clock == "modeled" for run in runs)
    return (f"note: {modeled} of these {len(runs)} runs have modeled times (an emulated cluster) "
            f"and {len(runs) - modeled} measured ones: their seconds are not comparable")


def overran_note(runs: list[RunRecord]) -> str | None:
    """One line for a comparison, plot or advice that holds runs whose modeled times overran
    their model (`RunRecord.timing`): their seconds are partly this machine's."""
    overran = [run.id for run in runs if run.timing == "overran"]
    if not overran:
        return None
    shown = ", ".join(map(str, overran[:10])) + (", ..." if len(overran) > 10 else "")
    return (f"note: run{'s' if len(overran) > 1 else ''} {shown}: timing overran (their real "
            f"work overran the modeled step time), so their seconds are partly this machine's")


def names(run: RunRecord, selector: str) -> bool:
    """Whether `selector` (a run id, an experiment name or a grid's base name) names `run`."""
    if selector.isdigit():
        return run.id == int(selector)
    return run.experiment == selector or run.experiment.startswith(f"{selector}[")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _comparable(value: Any) -> Any:
    """Numbers compare as numbers (4 == 4.0); anything else by its text (`sgp`, `true`)."""
    if _is_number(value):
        return float(value)
    if isinstance(value, (list, dict)):
        return json.dumps(value, sort_keys=True)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
