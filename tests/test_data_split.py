"""`data_split`: the random split is each epoch's seeded permutation cut into equal parts (as
before the key existed); `by_label` gives each worker a fixed, contiguous range of the
label-sorted set, reshuffled each epoch; a real run trains each worker on its own classes;
bad input is one line and exit 2."""

from __future__ import annotations

import pytest
import torch

from conftest import dsgd_in_process, write_spec
from dsgd_cli.results.store import Store
from dsgd_cli.spec.sharding import Shard

# 10 classes of 30 examples each, shuffled: 300 examples.
LABELS = torch.arange(10).repeat_interleave(30)[torch.randperm(300, generator=torch.Generator().manual_seed(1))]


def parts(world: int, epoch: int, split: str = "by_label", seed: int = 0) -> list[torch.Tensor]:
    return [Shard(300, rank, world, seed, split, LABELS).indices(epoch) for rank in range(world)]


def test_random_split_is_each_epochs_permutation_cut_in_equal_parts():
    for epoch in (0, 3):
        order = torch.randperm(300, generator=torch.Generator().manual_seed(7 * 1_000_003 + epoch))
        got = parts(4, epoch, "random", seed=7)
        assert all(torch.equal(got[r], order[r * 75:(r + 1) * 75]) for r in range(4))


@pytest.mark.parametrize("world", [2, 3, 4, 7, 10])
def test_by_label_gives_each_worker_a_contiguous_range_of_classes(world):
    size = 300 // world
    got = parts(world, epoch=0)
    everything = torch.cat(got)
    assert len(everything.unique()) == world * size  # disjoint, each of the same size
    ranges = [(int(LABELS[p].min()), int(LABELS[p].max())) for p in got]
    for (_, high), (low, _) in zip(ranges, ranges[1:]):
        assert high <= low  # rank r's labels all come before rank r + 1's
    # Sorted by label, so rank r holds exactly the labels at positions r·size … (r+1)·size.
    sorted_labels = LABELS.sort().values
    for rank, part in enumerate(got):
        assert torch.equal(LABELS[part].sort().values, sorted_labels[rank * size:(rank + 1) * size])
    if world == 10:
        assert all(low == high for low, high in ranges)  # one class per worker


def test_by_label_keeps_a_workers_examples_and_reshuffles_them_each_epoch():
    first, second = parts(4, epoch=0), parts(4, epoch=1)
    for a, b in zip(first, second):
        assert torch.equal(a.sort().values, b.sort().values)
        assert not torch.equal(a, b)
    assert torch.equal(parts(4, epoch=1)[2], second[2])  # a function of (seed, epoch) alone


def test_by_label_needs_one_label_per_example():
    with pytest.raises(ValueError, match=r"^data_split by_label needs one label per training "
                                         r"example; the task's targets have shape \(300, 5\)$"):
        Shard(300, 0, 2, 0, "by_label", torch.zeros(300, 5, dtype=torch.long))


def test_a_real_run_trains_each_worker_on_its_own_classes(tmp_path):
    """Local SGD without averaging on two classes: split by label, each worker holds one
    class, and its local loss falls to near zero within 16 steps (its output bias alone fits
    it); split at random, each worker's loss stays near the shared problem's."""
    spec = write_spec(tmp_path, """
        defaults:
          task: {name: synthetic, params: 4943, features: 16, classes: 2, samples: 512}
          workers: 2
          epochs: 2
          log_interval: 8
          optimizer: {name: sgd, lr: 0.5}
          aggregator: {name: local_sgd, period: 1000}
        experiments:
          - {name: label, data_split: by_label}
          - {name: shuffled}
    """)
    db = tmp_path / "r.db"
    result = dsgd_in_process("run", str(spec), "--db", str(db))
    assert result.returncode == 0, result.stdout + result.stderr
    store = Store(str(db))
    losses = {}
    for run in store.runs():
        assert run.config["data_split"] == ("by_label" if run.experiment == "label" else "random")
        losses[run.experiment] = [m.value for m in store.metric_history(run.id, "train_loss")
                                  if m.step == 16]
    assert len(losses["label"]) == len(losses["shuffled"]) == 2  # both ranks
    assert max(losses["label"]) < 0.1 and min(losses["shuffled"]) > 0.3, losses


@pytest.mark.parametrize("experiment, message", [
    ("{name: a, data_split: labels}",
     "experiments[0].data_split: expected one of random, by_label, got 'labels'"),
    ("{name: a, data_split: [by_label]}",
     "experiments[0].data_split: expected one of random, by_label, got ['by_label']"),
    ("{name: a, data_split: by_label, task: {name: text_lm, path: PATH}}",
     "experiments[0].data_split: by_label needs a task with one class label per example; "
     "task 'text_lm' has other targets"),
])
def test_bad_data_splits_are_one_line_and_exit_2(tmp_path, experiment, message):
    text = tmp_path / "text.txt"
    text.write_text("some text to model " * 200)
    spec = write_spec(tmp_path, f"""
        defaults: {{task: logreg, workers: 2}}
        experiments:
          - {experiment.replace("PATH", str(text))}
    """)
    result = dsgd_in_process("run", str(spec), "--db", str(tmp_path / "r.db"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr == f"dsgd: error: {spec}: {message}\n", result.stderr
    assert not (tmp_path / "r.db").exists()
