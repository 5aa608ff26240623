"""Fuzzing the spec loader: whatever a spec file holds, `load_spec` returns experiments or
raises a `DsgdError` whose message is one line. Any other exception is a bug (the CLI would
print a traceback instead of `dsgd: error: <file>: <key path>: ...`)."""

from __future__ import annotations

import copy
import dataclasses
import random
from pathlib import Path

import pytest

pytest.importorskip("hypothesis")
import yaml  # noqa: E402

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dsgd_cli.spec import registry  # noqa: E402
from dsgd_cli.errors import DsgdError  # noqa: E402
from dsgd_cli.options import option_fields  # noqa: E402
from dsgd_cli.spec.experiments import load_spec  # noqa: E402
from dsgd_cli.spec.specfile import EXPERIMENT_DEFAULTS  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = [ROOT / "experiments.yaml", *sorted((ROOT / "examples").glob("*.yaml"))]

PLUGIN_NAMES = sorted({name for kind in registry.KINDS for name in registry.discover(kind)})
OPTION_NAMES = sorted({f.name for kind in registry.KINDS for name in registry.discover(kind)
                       for f in option_fields(registry.load(kind, name).Options)})
SECTION_KEYS = ["bandwidth", "latency", "ranks", "slowdown", "random", "probability", "samples",
                "seconds", "evaluations", "compressor", "optimizer.lr", "aggregator.name",
                "aggregator.compressor.name", "task.name", "workers", "seed"]
REAL_KEYS = sorted({"defaults", "experiments", *EXPERIMENT_DEFAULTS, *OPTION_NAMES, *SECTION_KEYS})

# Every property is reproducible (derandomize), has no per-example deadline (a machine
# shared with other jobs is slow at times) and a bounded number of examples: the file runs in
# about 30 s on two busy cores.
QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]



# CHOCO's `gamma: auto` tunes again for every mutated spec whose tuning inputs differ: the
# fuzz checks what validation says, not which γ it picks (conftest's quick_gamma_tuning).
pytestmark = pytest.mark.usefixtures("quick_gamma_tuning")


# Values at the edges, where checks tend to be missing: huge and negative integers, floats
# beyond every bound, text with NUL or line breaks. (NaN and infinities are refused before
# anything else is looked at, so they come rarely, with the other junk.)
EDGES = [-1, 0, 2**31, 2**32, 2**63, 2**64, -2**63 - 1, 10**30, 3 * 10**13, 3e13, 1e308, 1e-320,
         10**400, 10**400, 10**400, "\x00", "a\nb", "1" + "0" * 400 + "s", "9" * 400 + "Gbit",
         "", "é", True, None, [], {}, 1025, 17, "random_regular"]
edges = st.sampled_from(EDGES)
scalars = st.one_of(
    edges,
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(PLUGIN_NAMES),
)
keys = st.one_of(st.sampled_from(REAL_KEYS), st.text(max_size=8), st.integers(-2, 2), st.none())
values = st.recursive(
    scalars,
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(keys, children, max_size=4)),
    max_leaves=12)


def _paths(node, prefix=()):
    """Every location in a YAML tree: (path of keys and indices, value)."""
    yield prefix, node
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _paths(value, prefix + (index,))


def _parent(document, path):
    node = document
    for part in path[:-1]:
        node = node[part]
    return node


def _option(field) -> st.SearchStrategy:
    """Values a plugin option takes: near its default."""
    default = field.default
    if isinstance(default, bool):
        return st.booleans()
    if isinstance(default, int):
        return st.integers(max(0, default - 2), default + 2)
    if isinstance(default, float):
        return st.floats(0, 1)
    return st.just(default)


def _section(kind: str, names: list[str] | None = None) -> st.SearchStrategy:
    """`{name: PLUGIN, option: value, ...}` with the plugin's own option names."""
    def with_options(name):
        fields = [f for f in option_fields(registry.load(kind, name).Options)
                  if f.default is not dataclasses.MISSING]
        return st.fixed_dictionaries({"name": st.just(name)},
                                     optional={f.name: _option(f) for f in fields})
    return st.sampled_from(sorted(names or registry.discover(kind))).flatmap(with_options)


small = st.integers(1, 4)
# A plausible value of each experiment key; the documents then get a few edge values anywhere.
PLAUSIBLE = {
    "task": _section("task", ["logreg", "digits_cnn", "mnist1d_mlp", "mnist1d_cnn"]),
    "optimizer": _section("optimizer"),
    "aggregator": st.one_of(
        _section("aggregator"),
        st.tuples(_section("aggregator", ["allreduce"]), _section("compressor")).map(
            lambda pair: {**pair[0], "compressor": pair[1]})),
    "workers": st.integers(1, 8), "epochs": small, "batch_size": small,
    "seed": st.integers(0, 3), "steps_per_epoch": st.none() | small, "log_interval": small,
    "target_accuracy": st.floats(0.1, 1), "save_dir": st.none() | st.just("models"),
    "network": st.fixed_dictionaries({}, optional={
        "bandwidth": st.sampled_from(["1Gbit", "10MB/s", 1e9]),
        "latency": st.sampled_from(["100us", "2ms", 0.001])}),
    "stragglers": st.fixed_dictionaries({}, optional={
        "ranks": st.lists(st.integers(0, 1), max_size=2), "slowdown": st.floats(1, 4),
        "random": st.fixed_dictionaries({"probability": st.floats(0, 1),
                                         "slowdown": st.floats(1, 4)})}),
    "budget": st.one_of(
        st.fixed_dictionaries({"samples": st.integers(1, 10**6)}, optional={"evaluations": small}),
        st.fixed_dictionaries({"seconds": st.floats(0.1, 10)}, optional={"evaluations": small})),
    "grid": st.dictionaries(
        st.sampled_from(["seed", "workers", "epochs", "optimizer.lr", "optimizer.name",
                         "aggregator.name", "aggregator.compressor.name", "aggregator.period",
                         "aggregator.topology", "task.samples", "task.name", "network"]),
        st.lists(st.sampled_from([0, 1, 2, 8, 0.1, "ring", "random_regular", *PLUGIN_NAMES]),
                 min_size=1, max_size=3),
        min_size=1, max_size=2),
}
experiment = st.fixed_dictionaries(
    {"name": st.text("abcxyz-", min_size=1, max_size=5), "task": PLAUSIBLE["task"]},
    optional={key: PLAUSIBLE[key] for key in sorted(PLAUSIBLE) if key != "task"})
defaults = st.fixed_dictionaries(
    {}, optional={key: PLAUSIBLE[key] for key in sorted(PLAUSIBLE) if key != "grid"})
plausible = st.fixed_dictionaries({"experiments": st.lists(experiment, min_size=1, max_size=3)},
                                  optional={"defaults": defaults})


@st.composite
def documents(draw):
    """A plausible spec with one to three values anywhere in it replaced by an edge value or
    by anything at all, or (one time in five) any YAML document whatever. Where to put them
    is drawn uniformly (hypothesis favours the first of many choices)."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.one_of(values, st.dictionaries(keys, values, max_size=3)))
    # Copies: the edge values `[]` and `{}` are shared objects, never to be changed in place.
    document = copy.deepcopy(draw(plausible))
    rng = random.Random(f"{draw(st.integers(0, 2**32 - 1))}:{document!r}")  # well spread
    for _ in range(rng.randint(1, 3)):
        locations = list(_paths(document))[1:]
        leaves = [(p, v) for p, v in locations if not isinstance(v, (dict, list))]
        path, value = rng.choice(leaves if leaves and rng.random() < 0.8 else locations)
        new = copy.deepcopy(rng.choice(EDGES) if rng.random() < 0.75 else draw(values))
        parent = _parent(document, path)
        if isinstance(value, dict) and rng.random() < 0.5:
            value[draw(keys)] = new  # an unknown (or repeated) key
        else:
            parent[path[-1]] = new
    return document


def _check(spec: Path) -> None:
    """load_spec either works or fails with one line; nothing else."""
    try:
        experiments = load_spec(spec)
    except DsgdError as error:
        message = str(error)
        assert message.splitlines() == [message], f"not one line: {message!r}"
        assert message.startswith(f"{spec}: "), message
        return
    assert experiments and all(e.config["name"] == e.name for e in experiments)


def _spec_file(tmp_path_factory) -> Path:
    """One file the examples of a test overwrite in turn (not a directory per example)."""
    directory = tmp_path_factory.getbasetemp() / "fuzz"
    directory.mkdir(exist_ok=True)
    return directory / "spec.yaml"


def _write(spec: Path, document) -> Path | None:
    try:
        text = yaml.safe_dump(document, allow_unicode=True, sort_keys=False)
    except (yaml.YAMLError, ValueError):  # a value YAML cannot write (an int of 4300+ digits)
        return None
    spec.write_text(text, encoding="utf-8")
    return spec


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=QUIET)
@given(document=documents())
def test_random_documents_load_or_fail_in_one_line(tmp_path_factory, document):
    spec = _write(_spec_file(tmp_path_factory), document)
    if spec is not None:
        _check(spec)


def _retype(value):
    """The same content as another type: a scalar in a list, a list as a mapping, text."""
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, list):
        return {str(i): v for i, v in enumerate(value)}
    if isinstance(value, str):
        return [value]
    return str(value)


MUTATIONS = ["delete", "replace", "retype", "insert"]


def _mutate(document, data, rng: random.Random) -> object:
    """One mutation at a location drawn uniformly (`rng`): delete it, replace it with a scalar
    (an edge value or any), give it another type, or insert an unknown key or item."""
    path, value = rng.choice(list(_paths(document)))
    mutation = rng.choice(MUTATIONS)
    scalar = rng.choice(EDGES) if rng.random() < 0.6 else data.draw(scalars, label="scalar")
    if mutation == "insert":
        if isinstance(value, dict):
            value[data.draw(keys, label="new key")] = data.draw(values, label="new value")
            return document
        if isinstance(value, list):
            value.append(data.draw(values, label="new item"))
            return document
        mutation = "replace"
    if not path:  # the whole document
        return scalar if mutation != "retype" else _retype(document)
    parent, last = _parent(document, path), path[-1]
    if mutation == "delete":
        del parent[last]
    elif mutation == "replace":
        parent[last] = scalar
    else:
        parent[last] = _retype(value)
    return document


EXAMPLE_DOCUMENTS = {spec.name: yaml.safe_load(spec.read_text()) for spec in EXAMPLES}


@settings(max_examples=400, deadline=None, derandomize=True, database=None,
          suppress_health_check=QUIET)
@given(name=st.sampled_from(sorted(EXAMPLE_DOCUMENTS)), data=st.data())
def test_mutated_examples_load_or_fail_in_one_line(tmp_path_factory, name, data):
    document = copy.deepcopy(EXAMPLE_DOCUMENTS[name])
    rng = random.Random(f"{name}:{data.draw(st.integers(0, 2**32 - 1), label='seed')}")
    for _ in range(rng.randint(1, 3)):
        document = _mutate(document, data, rng)
    spec = _write(_spec_file(tmp_path_factory), document)
    if spec is not None:
        _check(spec)


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=QUIET)
@given(content=st.one_of(st.binary(max_size=80),
                         st.text(max_size=80).map(lambda t: t.encode("utf-8")),
                         st.sampled_from([b"\xff\xfeexperiments: []", b"experiments:\n  - &a [*a]\n",
                                          b"seed: 1" + b"0" * 5000, b"[" * 2000 + b"]" * 2000,
                                          b"experiments: [{name: a, task: logreg, seed: caf\xe9}]"])))
def test_random_bytes_load_or_fail_in_one_line(tmp_path_factory, content):
    spec = _spec_file(tmp_path_factory)
    spec.write_bytes(content)
    _check(spec)
