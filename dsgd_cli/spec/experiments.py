"""The experiment spec: YAML in, a list of fully resolved and validated experiments out.

Resolution order: read YAML → merge `defaults` into each experiment → expand `grid` →
apply command-line overrides → validate every key and resolve every plugin. Nothing launches
unless every experiment passes; every error is a `SpecError` naming the file and key path.
Numbers may use scientific notation (`1e-3`), and NaN or infinity (`.nan`, `.inf`) is an error.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from dsgd_cli.spec import registry, specfile
from dsgd_cli.spec.failures_spec import FailureDomains, check_failures
from dsgd_cli.spec.cluster_spec import network_model, slowest_speed  # noqa: F401 (network_model: imported from here)
from dsgd_cli.emulation.clock import Clock
from dsgd_cli.spec.directories import problem_without_creating, shared_problem
from dsgd_cli.errors import SpecError
from dsgd_cli.spec.learning_rate import last_step
from dsgd_cli.spec.nodes import NodePlan, check_split
from dsgd_cli.spec.experiment_options import PLUGIN_KEYS, ExperimentOptions
from dsgd_cli.spec.config_versions import CONFIG_VERSION
from dsgd_cli.spec.resolved import KEYS, ResolvedExperiment, read_key, stored
from dsgd_cli.spec.run_plan import RunPlan, plan_entry
from dsgd_cli.options import options_to_dict, parse_options, show
from dsgd_cli.spec.specfile import one_line, selected
from dsgd_cli.topology import TOPOLOGY_KINDS
from dsgd_cli.spec.sharding import Shard, steps_per_epoch
from dsgd_cli.spec.transfer_time import check_model_crosses_in_time, model_bytes, needs_model_size

PLUGIN_SECTIONS = PLUGIN_KEYS  # the sections of a resolved config that name a plugin


@dataclass
class Experiment:
    """One run to launch: its name and its complete, JSON-serializable configuration, and
    where it keeps checkpoints: `checkpoint_dir` (when the spec asks for them), `resume_step`
    and `run_id` when it continues an earlier run from that step."""

    name: str
    config: dict[str, Any]
    checkpoint_dir: str | None = None
    resume_step: int | None = None
    run_id: int | None = None
    nodes: NodePlan | None = None  # this machine's part when the run spans several
    spec_text: str = ""  # names the rendezvous of a run over several machines

    @cached_property
    def resolved(self) -> ResolvedExperiment:
        """The configuration as the typed experiment, read once: what the launcher and the
        commands read of it (the configuration itself is what is stored and sent)."""
        return ResolvedExperiment.from_config(self.config)

    @property
    def run_plan(self) -> RunPlan:
        return RunPlan(self.run_id, self.resume_step, self.checkpoint_dir)

    def worker_config(self) -> dict[str, Any]:
        """What its workers are given (an entry of the launch plan): the configuration, and
        beside it the run plan: where to checkpoint and resume, and the run id when they tell
        other machines' workers which run they are in."""
        return plan_entry(self.config, self.run_plan)

    @property
    def workers(self) -> int:
        return self.resolved.workers


def load_spec(path: str | Path, *, only: list[str] | None = None,
              workers: int | None = None, launch: dict[str, Any] | None = None,
              overrides: list[tuple[str, Any]] = ()) -> list[Experiment]:
    """Read, expand and validate the spec at `path`; `only` selects experiments by name;
    `workers`, `launch` (the keys of its `launch:` section) and `overrides` (`--set`) are the
    command line's."""
    file = str(path)
    document = None  # once read: where an error's value was written (`_located`)
    try:
        text, document = specfile.read_document(Path(path))
        try:
            experiments = resolve_document(document, workers_override=workers,
                                           launch_override=launch, overrides=overrides,
                                           only=only)
        except RecursionError:  # a YAML alias inside itself (`&a [*a]`), or absurd nesting
            raise SpecError(specfile.TOO_DEEP) from None
        for experiment in experiments:
            experiment.spec_text = text
        return select(experiments, only)
    except SpecError as error:
        raise _located(error, file, [key for key, _ in overrides], document,
                       workers_given=workers is not None) from None


def _located(error: SpecError, file: str, set_keys: list[str],
             document: Any = None, workers_given: bool = False) -> SpecError:
    """`error` naming where the bad value was written: the `--set KEY` whose value holds its
    key path, else the spec file, at `defaults.KEY` where the experiment took it from the
    spec's `defaults` (not `workers` when `--workers` set it). One line whatever the spec
    holds: a key may contain a line break."""
    path = error.path
    where = error.file  # set already where a --set key itself is wrong
    set_key = specfile.set_key_holding(path, set_keys)
    if set_key is not None:
        where = specfile.set_origin(set_key)
        inside = path.split(".", 1)[1]  # the key path within the experiment
        path = None if inside == set_key else inside
    detail = error.detail
    given = workers_given and (path or "").endswith("].workers")
    if set_key is None and where is None and isinstance(document, dict) and not given:
        written = specfile.defaults_path(path, document.get("defaults") or {},
                                         document.get("experiments") or [])
        if written is not None:
            # Met in the first experiment, the value is wrong in itself; in a later one, it
            # is wrong with what that experiment sets: say which.
            experiment = path.split(".", 1)[0]
            if experiment != "experiments[0]":
                detail = f"{detail} (in {experiment})"
            path = written
    return SpecError(one_line(detail), file=one_line(where or file),
                     path=one_line(path) if path else None)


def resolve_document(document: Any, workers_override: int | None = None,
                     launch_override: dict[str, Any] | None = None,
                     overrides: list[tuple[str, Any]] = (),
                     only: list[str] | None = None) -> list[Experiment]:
    """Every experiment of the spec, validated; `overrides` (`--set`) set in those `only`
    (`--experiment`) selects."""
    defaults, entries, nodes = specfile.sections(document, launch_override)
    experiments: list[Experiment] = []
    cache = _Cache()  # grid points share most sections: each distinct one is checked once
    for point in specfile.points(defaults, entries, workers_override, overrides, only):
        config = validate_experiment(point.raw, point.path, point.name, cache, nodes)
        experiments.append(Experiment(point.name, config, nodes=nodes))

    seen: dict[str, int] = {}
    for experiment in experiments:
        if experiment.name in seen:
            raise SpecError(f"duplicate experiment name {experiment.name!r}", path="experiments")
        seen[experiment.name] = 1
    return experiments


def validate_experiment(raw: dict, path: str, name: str, cache: _Cache | None = None,
                        nodes: NodePlan | None = None) -> dict[str, Any]:
    """Check every key and resolve every plugin; return the complete configuration.
    `cache` remembers what was checked for sections seen before (grid points); `nodes`: the
    machines a run over several is split over."""
    cache = cache if cache is not None else _Cache()
    keys = parse_options(ExperimentOptions, {key: value for key, value in raw.items()
                                             if key not in ("name", "grid")}, path)
    config: dict[str, Any] = {"config_version": CONFIG_VERSION, "name": name,
                              **_declared_keys(keys),
                              "save_dir": _directory(keys.save_dir, f"{path}.save_dir")}
    # `config`: the declared keys as stored, all the checks below read; the plugin sections
    # join it at the end.
    check_step_fits_timeout(keys, slowest_speed(config), path)

    # The plugin sections, each checked by the plugin it names: {name, every option}.
    task, task_key = cache.section("task", raw["task"], f"{path}.task")
    optimizer, _ = cache.section("optimizer", raw["optimizer"], f"{path}.optimizer")
    aggregator = raw["aggregator"]
    compressor_raw: Any = _NO_COMPRESSOR
    if isinstance(aggregator, dict) and "compressor" in aggregator:
        compressor_raw = aggregator["compressor"]
        aggregator = {k: v for k, v in aggregator.items() if k != "compressor"}
    aggregator, aggregator_key = cache.section("aggregator", aggregator, f"{path}.aggregator")
    compressor, compressor_key = cache.section("compressor", compressor_raw,
                                               f"{path}.aggregator.compressor")
    if keys.data_split == "by_label":
        task_cls = registry.load("task", task["name"])
        if not task_cls.one_label_per_example:
            raise SpecError(f"by_label needs a task with one class label per example; task "
                            f"{task['name']!r} has other targets", path=f"{path}.data_split")
    examples = cache.train_examples(task, task_key, f"{path}.task")
    if examples is not None and keys.workers > examples:
        raise SpecError(f"{keys.workers} workers but task {task['name']!r} has "
                        f"{examples} training example{'s' if examples != 1 else ''}; each worker "
                        f"needs at least one", path=f"{path}.workers")
    schedule, schedule_key = cache.section("lr_schedule", raw["lr_schedule"],
                                           f"{path}.lr_schedule")
    _check_schedule(keys, schedule, examples, f"{path}.lr_schedule", cache, schedule_key)
    aggregator_cls = registry.load("aggregator", aggregator["name"])
    if compressor["name"] != "none" and not aggregator_cls.supports_compression:
        raise SpecError(f"aggregator {aggregator_cls.plugin_name!r} does not support compression",
                        path=f"{path}.aggregator.compressor")
    if aggregator_cls.supports_compression:
        cache.check_compressor(aggregator_cls, aggregator, aggregator_key, compressor,
                               compressor_key, f"{path}.aggregator.compressor")
    cache.check_world(aggregator, aggregator_key, keys.workers, keys.seed, f"{path}.aggregator")
    budget, compute = read_key(config, "budget"), read_key(config, "compute")
    check_failures(read_key(config, "failures"), aggregator_cls, f"{path}.failures",
                   domains=FailureDomains.of(keys.workers, read_key(config, "cluster")),
                   samples_budget=budget is not None and budget.samples is not None,
                   step_seconds=None if compute is None else compute.step_seconds,
                   total_steps=None if examples is None else _planned_steps(keys, examples)[0])
    compressed = compressor["name"] != "none"
    nbytes = cache.model_bytes(task, task_key) if needs_model_size(config, compressed) else None
    check_model_crosses_in_time(config, compressed, nbytes, path)
    aggregator = cache.resolve(aggregator_cls, aggregator, compressor, task, keys,
                               (aggregator_key, compressor_key, task_key), f"{path}.aggregator")
    if nodes is not None:
        check_split(nodes, keys.workers, path)
    plugins = dict(task=task, optimizer=optimizer, aggregator=aggregator, compressor=compressor,
                   lr_schedule=schedule)
    machines = {} if nodes is None else {"nnodes": nodes.nnodes}  # a run over several: how many
    return dict(sorted({**config, **plugins, **machines}.items(),
                       key=lambda item: _STORED_ORDER[item[0]]))


_STORED_ORDER = {key.name: index for index, key in enumerate(KEYS)}  # the configuration's


def _declared_keys(keys: ExperimentOptions) -> dict[str, Any]:
    """Every declared key but the plugin sections, as the configuration stores it
    (resolved.py); a key stored only when set is left out at its default."""
    declared = [(key, getattr(keys, key.name)) for key in KEYS
                if key.name not in ("config_version", "name", "nnodes", *PLUGIN_KEYS)]
    return {key.name: stored(value) for key, value in declared
            if key.always or value != key.default}


def _check_schedule(keys: ExperimentOptions, schedule: dict[str, Any], examples: int | None,
                    path: str, cache: _Cache, key: Any) -> None:
    """The learning-rate schedule fits the run (its warm-up is not longer, cosine knows the
    last step). With a task that cannot say its size before loading, the workers check it."""
    by_seconds = keys.budget is not None and keys.budget.seconds is not None
    if examples is None and not by_seconds:
        return
    total, per_epoch = _planned_steps(keys, examples)
    if key is not None and (key, total, per_epoch) in cache.schedules:
        return
    cls = registry.load("lr_schedule", schedule["name"])
    try:
        cls.check_run(build_options("lr_schedule", schedule), total, per_epoch)
    except ValueError as error:
        raise SpecError(str(error), path=path) from None
    if key is not None:
        cache.schedules.add((key, total, per_epoch))


def _planned_steps(keys: ExperimentOptions, examples: int | None) -> tuple[int | None, int]:
    """The run's last step per worker (None under a seconds budget) and its steps per epoch;
    without a known training set size (only under a seconds budget is that asked) both as if
    each worker had one example."""
    shard_size, per_epoch = 1, 1
    if examples is not None:
        shard = Shard(examples, 0, keys.workers, keys.seed)
        shard_size = shard.size
        per_epoch = steps_per_epoch(shard, keys.batch_size, keys.steps_per_epoch)
    return last_step(keys, shard_size, per_epoch), per_epoch


_NO_COMPRESSOR = {"name": "none"}  # the section of an aggregator without one (never changed)


def _directory(value: Any, path: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise SpecError(f"expected a directory path, got {show(value)}", path=path)
    try:
        directory = Path(value).resolve()
    except (OSError, ValueError) as error:  # ValueError: a NUL character in the path
        raise SpecError(f"expected a directory path, got {show(value)} ({error})", path=path) from None
    problem = problem_without_creating(directory)
    if problem is None and directory.is_dir():
        problem = shared_problem(directory)  # others could swap an experiment's directory
        problem = problem and f"it {problem}"
    if problem is not None:
        raise SpecError(f"cannot save models in {directory}: {problem}", path=path)
    return str(directory)


def check_world(aggregator_cls: type, options: Any, workers: int, seed: int) -> bool:
    """Run the aggregator's `check_world` for the run's workers and seed: the gossip plugins
    check the graph their workers will draw with it. A `check_world(options, world_size)` of
    a plugin written before the seed was passed is called without it. Raises ValueError as
    `check_world` does; returns whether the outcome may depend on the seed."""
    if "seed" not in inspect.signature(aggregator_cls.check_world).parameters:
        aggregator_cls.check_world(options, workers)
        return False
    seeded = _draws_with_seed(aggregator_cls, options)
    try:
        aggregator_cls.check_world(options, workers, seed=seed)
    except ValueError as error:
        if not seeded:
            raise
        raise ValueError(f"{error} (the graph drawn with the run's seed, {seed})") from None
    return seeded


def _draws_with_seed(aggregator_cls: type, options: Any) -> bool:
    """Whether the aggregator's check may differ from seed to seed: not for the base's no-op
    nor for a built-in graph that is not drawn at random; otherwise it may."""
    from dsgd_cli.api import Aggregator  # imported already: `aggregator_cls` derives from it

    if getattr(aggregator_cls.check_world, "__func__", None) is Aggregator.check_world.__func__:
        return False
    topology = getattr(options, "topology", None)
    if isinstance(topology, str) and topology in TOPOLOGY_KINDS:
        return TOPOLOGY_KINDS[topology].seeded
    return True


def _freeze(value: Any) -> Any:
    """A hashable key equal for equal spec values (1, 1.0 and true differ); TypeError if
    the value holds something else than YAML's plain types."""
    kind = type(value)
    if kind in _PLAIN:
        return kind, value
    if kind is float:
        return float, repr(value)  # 0.0 and -0.0 differ
    if kind is list:
        return list, tuple(map(_freeze, value))
    if kind is dict:
        # Keys as they are: a section whose keys are not its options' names is never cached.
        return dict, tuple([(k, _freeze(v)) for k, v in value.items()])
    raise TypeError(kind.__name__)


_PLAIN = (type(None), bool, int, str)


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


@dataclass
class _Cache:
    """What validation found for each distinct section: a grid of 100,000 points over two
    keys has a few hundred distinct sections, and each is checked once. Only successes are
    kept (an error stops validation), and a result is only reused for an equal input: a
    section's content is its key, and grid points that share a section object (every section
    the grid does not set) find it by identity first."""

    keys: dict = field(default_factory=dict)      # (kind, id(raw)) -> (raw, key); raw kept alive
    sections: dict = field(default_factory=dict)  # key -> (resolved section, flat?)
    examples: dict = field(default_factory=dict)  # task key -> train_examples()
    sizes: dict = field(default_factory=dict)     # task key -> its model's parameter bytes
    worlds: set = field(default_factory=set)      # (aggregator key, workers, seed or None)
    schedules: set = field(default_factory=set)   # (schedule key, total steps, steps per epoch)
    compressors: set = field(default_factory=set)  # (aggregator key, compressor key)
    resolved: dict = field(default_factory=dict)   # (section keys, workers, seed) -> aggregator

    def key(self, kind: str, raw: Any) -> Any:
        known = self.keys.get((kind, id(raw)))
        if known is not None and known[0] is raw:
            return known[1]
        try:
            key = (kind, _freeze(raw))
        except TypeError:  # a date, a set: not cached, and the check says what is wrong
            return None
        if isinstance(raw, (dict, list)):
            self.keys[(kind, id(raw))] = (raw, key)
        return key

    def section(self, kind: str, raw: Any, path: str) -> tuple[dict[str, Any], Any]:
        """The resolved section, and the key of its content (None: not cacheable)."""
        key = self.key(kind, raw)
        if key is None:
            return registry.plugin_section(kind, raw, path), None
        if key not in self.sections:
            resolved = registry.plugin_section(kind, raw, path)
            flat = not any(isinstance(v, (dict, list)) for v in resolved.values())
            self.sections[key] = resolved, flat
        resolved, flat = self.sections[key]
        return (dict(resolved) if flat else _copy(resolved)), key

    def train_examples(self, task: dict[str, Any], key: Any, path: str) -> int | None:
        if key is None:
            return _train_examples(task, path)
        if key not in self.examples:
            self.examples[key] = _train_examples(task, path)
        return self.examples[key]

    def model_bytes(self, task: dict[str, Any], key: Any) -> int | None:
        if key is None:
            return model_bytes(task)
        if key not in self.sizes:
            self.sizes[key] = model_bytes(task)
        return self.sizes[key]

    def check_compressor(self, cls: type, aggregator: dict[str, Any], aggregator_key: Any,
                         compressor: dict[str, Any], compressor_key: Any, path: str) -> None:
        """The aggregator's `check_compressor` (choco refuses compressors that are not
        contractive), once per pair of sections; skipped where it is the base's no-op."""
        from dsgd_cli.plugin_base import Aggregator  # imported already: `cls` derives from it

        if getattr(cls.check_compressor, "__func__", None) is Aggregator.check_compressor.__func__:
            return
        key = (aggregator_key, compressor_key)
        if None not in key and key in self.compressors:
            return
        try:
            cls.check_compressor(build_options("aggregator", aggregator),
                                 build_plugin("compressor", compressor))
        except ValueError as error:
            raise SpecError(str(error), path=path) from None
        if None not in key:
            self.compressors.add(key)

    def resolve(self, cls: type, aggregator: dict[str, Any], compressor: dict[str, Any],
                task: dict[str, Any], keys: ExperimentOptions, section_keys: tuple,
                path: str) -> dict[str, Any]:
        """The aggregator section with the aggregator's `resolve_options` applied (choco's
        `gamma: auto` becomes the γ it tunes), once per distinct input (`section_keys`: those
        of the aggregator, compressor and task sections); unchanged where it is the base's
        no-op."""
        from dsgd_cli.plugin_base import Aggregator  # imported already: `cls` derives from it

        if getattr(cls.resolve_options, "__func__", None) is Aggregator.resolve_options.__func__:
            return aggregator
        key = (*section_keys, keys.workers, keys.seed)
        cacheable = None not in section_keys
        if not cacheable or key not in self.resolved:
            try:
                options = cls.resolve_options(
                    build_options("aggregator", aggregator), build_plugin("compressor", compressor),
                    build_plugin("task", task), keys.workers, keys.seed)
            except ValueError as error:
                raise SpecError(str(error), path=path) from None
            resolved = {"name": aggregator["name"], **options_to_dict(options)}
            if not cacheable:
                return resolved
            self.resolved[key] = resolved
        return _copy(self.resolved[key])

    def check_world(self, aggregator: dict[str, Any], key: Any, workers: int, seed: int,
                    path: str) -> None:
        if key is not None and ((key, workers, None) in self.worlds
                                or (key, workers, seed) in self.worlds):
            return
        cls = registry.load("aggregator", aggregator["name"])
        try:
            depends = check_world(cls, build_options("aggregator", aggregator), workers, seed)
        except ValueError as error:
            raise SpecError(str(error), path=path) from None
        if key is not None:
            self.worlds.add((key, workers, seed if depends else None))


def _train_examples(task: dict[str, Any], path: str) -> int | None:
    """The task's `train_examples()`, from its options alone (nothing is loaded)."""
    name = task["name"]
    try:
        count = build_plugin("task", task).train_examples()
    except Exception as error:  # third-party code: say whose, in one line
        raise SpecError(f"task {name!r}: train_examples() failed: "
                        f"{type(error).__name__}: {error}", path=path) from None
    if count is not None and (isinstance(count, bool) or not isinstance(count, int)):
        raise SpecError(f"task {name!r}: train_examples() returned {show(count)}, "
                        f"expected an integer or None", path=path)
    return count


build_options = registry.build_options
build_plugin = registry.build  # the name tests and older code import from here


def check_step_fits_timeout(keys: ExperimentOptions, slowest_speed: float, path: str) -> None:
    """A modeled step stretched by the time scale (and the stragglers' slowdown) lasts that
    long in real time, and timeouts are real: a step as long as the timeout would fail.
    `slowest_speed`: the slowest node's relative speed (1 without a cluster's speeds)."""
    compute, stragglers = keys.compute, keys.stragglers
    if compute is None:
        return
    real = Clock(compute.time_scale).to_real(compute.step_seconds) / slowest_speed
    if stragglers is not None:
        real *= stragglers.slowdown if stragglers.ranks else 1.0
        real *= stragglers.random.slowdown if stragglers.random else 1.0
    if real >= keys.timeout:
        raise SpecError(f"a step lasts {real:g} real seconds (step_seconds × time_scale × "
                        f"slowdown), not less than the timeout ({keys.timeout:g} s); "
                        f"raise timeout or lower time_scale", path=f"{path}.compute")


def select(experiments: list[Experiment], only: list[str] | None) -> list[Experiment]:
    """Keep experiments named in `only`: an exact name, or a grid's base name."""
    if not only:
        return experiments
    chosen = [e for e in experiments if selected(e.name, only)]
    missing = [n for n in only if not any(selected(e.name, [n]) for e in experiments)]
    if missing:
        known = ", ".join(e.name for e in experiments[:20])
        if len(experiments) > 20:  # a grid of 100,000 points: not all of them on one line
            known += f", … ({len(experiments)} in all)"
        raise SpecError(f"no experiment named {missing[0]!r} (the spec has: {known})", path="experiments")
    return chosen
