"""CIFAR tasks on a small generated set in CIFAR's own python-pickle format: the reader reads
it exactly, augmentation is seeded per worker and step, the ResNets have the published
parameter counts, a missing or damaged directory is one line and exit 2, and a real run
trains ResNet-20 with batch norm on it."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import dsgd_in_process, write_spec
from dsgd_cli.spec.experiments import build_plugin, load_spec
from dsgd_cli.results.store import Store
from dsgd_cli.worker.data import augmentation_generator
from plugins.tasks.cifar import CIFAR10, CIFAR100, augment, read


def write_cifar(directory: Path, layout=CIFAR10, per_file: int = 8, seed: int = 0) -> dict:
    """A small data set in the layout of CIFAR's python batches, pickled as the originals
    (protocol 2, byte-string keys); returns what was written, per file."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    written = {}
    for name in [*layout.train_files, layout.test_file]:
        data = rng.integers(0, 256, size=(per_file, 3 * 32 * 32), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, layout.classes, size=per_file)]
        batch = {b"batch_label": name.encode(), b"data": data,
                 layout.label_key.encode(): labels,
                 b"filenames": [f"{name}_{i}.png".encode() for i in range(per_file)]}
        if layout is CIFAR100:
            batch[b"coarse_labels"] = [label // 5 for label in labels]
        with open(directory / name, "wb") as file:
            pickle.dump(batch, file, protocol=2)
        written[name] = (data, labels)
    return written


@pytest.fixture(scope="module")
def cifar10(tmp_path_factory):
    directory = tmp_path_factory.mktemp("data") / "cifar-10-batches-py"
    return directory, write_cifar(directory)


@pytest.mark.parametrize("layout", [CIFAR10, CIFAR100], ids=["cifar10", "cifar100"])
def test_the_reader_reads_the_batches_exactly(tmp_path, layout):
    written = write_cifar(tmp_path / layout.folder, layout)
    data = read(tmp_path / layout.folder, layout)
    train = [written[name] for name in layout.train_files]
    assert data.train_x.dtype == torch.uint8 and data.train_x.shape == (8 * len(train), 3, 32, 32)
    expected_x = np.concatenate([x for x, _ in train]).reshape(-1, 3, 32, 32)
    assert np.array_equal(data.train_x.numpy(), expected_x)
    assert data.train_y.tolist() == [label for _, labels in train for label in labels]
    test_x, test_y = written[layout.test_file]
    assert np.array_equal(data.test_x.numpy(), test_x.reshape(-1, 3, 32, 32))
    assert data.test_y.tolist() == test_y
    # CIFAR's layout: 1024 red values, then green, then blue, each row by row.
    assert data.train_x[0, 1, 0, 2] == train[0][0][0, 1024 + 2]
    assert data.train_x[0, 2, 3, 0] == train[0][0][0, 2048 + 3 * 32]


def test_data_dir_defaults_to_dsgd_data(cifar10, monkeypatch):
    directory, _ = cifar10
    monkeypatch.setenv("DSGD_DATA", str(directory.parent))
    task = build_plugin("task", {"name": "cifar10_resnet", "depth": 20, "data_dir": None,
                                 "augment": True})
    assert task.options.data_dir == str(directory.resolve())
    assert task.train_examples() == 40


def test_augmentation_is_seeded_and_differs_between_workers():
    images = torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8)
    same = [augment(images, augmentation_generator(seed=3, rank=0, step=5)) for _ in range(2)]
    assert torch.equal(same[0], same[1])
    other_rank = augment(images, augmentation_generator(seed=3, rank=1, step=5))
    other_step = augment(images, augmentation_generator(seed=3, rank=0, step=6))
    assert not torch.equal(same[0], other_rank) and not torch.equal(same[0], other_step)


def test_augmentation_is_a_padded_crop_flipped_or_not():
    """Each augmented image is a 32x32 window of the image padded with 4 black pixels, read
    left to right or right to left; over many images every offset and both flips occur."""
    images = torch.randint(1, 256, (200, 3, 32, 32), dtype=torch.uint8)  # no black pixel
    out = augment(images, augmentation_generator(0, 0, 0))
    padded = torch.nn.functional.pad(images, (4, 4, 4, 4))
    seen = set()
    for image, result in zip(padded, out):
        matches = [(top, left, flip) for top in range(9) for left in range(9)
                   for flip in (False, True)
                   if torch.equal(result, (lambda w: w.flip(2) if flip else w)(
                       image[:, top:top + 32, left:left + 32]))]
        assert matches, "not a window of the padded image"
        seen.update(matches)
    assert {top for top, _, _ in seen} == set(range(9))
    assert {flip for _, _, flip in seen} == {False, True}


@pytest.mark.parametrize("depth, params", [(20, 269_722), (32, 464_154), (56, 853_018)])
def test_resnets_have_the_published_parameter_counts(cifar10, depth, params):
    """He et al. (2016), table 6: 0.27M, 0.46M and 0.85M parameters."""
    directory, _ = cifar10
    task = build_plugin("task", {"name": "cifar10_resnet", "depth": depth,
                                 "data_dir": str(directory), "augment": True})
    model = task.build_model()
    assert sum(p.numel() for p in model.parameters()) == params
    batch_norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(batch_norms) == depth - 1  # every convolution but none of the shortcuts
    output = model(torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8))
    assert output.shape == (2, 10)


def test_missing_and_damaged_data_are_one_line_and_exit_2(tmp_path, cifar10, monkeypatch):
    directory, _ = cifar10
    damaged = tmp_path / "damaged"
    write_cifar(damaged)
    (damaged / "data_batch_3").write_bytes((damaged / "data_batch_3").read_bytes()[:1000])
    partial = tmp_path / "partial"
    write_cifar(partial)
    (partial / "test_batch").unlink()
    monkeypatch.delenv("DSGD_DATA", raising=False)
    how = "download https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz and extract it"
    for data_dir, message in [
            (tmp_path / "nowhere", f"no CIFAR-10 data at {tmp_path / 'nowhere'} (not a directory)"),
            (partial, f"{partial} is not CIFAR-10's cifar-10-batches-py: test_batch missing"),
            (damaged, f"{damaged / 'data_batch_3'} is not a CIFAR-10 batch"),
            (None, "data_dir: not set, nor $DSGD_DATA")]:
        spec = write_spec(tmp_path, f"""
            experiments:
              - name: a
                task: {{name: cifar10_resnet, data_dir: {'null' if data_dir is None else data_dir}}}
        """)
        result = dsgd_in_process("run", str(spec), "--db", str(tmp_path / "r.db"))
        assert result.returncode == 2, result.stderr
        assert f"{spec}: experiments[0].task: " in result.stderr, result.stderr
        assert message in result.stderr and how in result.stderr, result.stderr
        assert len(result.stderr.splitlines()) == 1
        assert not (tmp_path / "r.db").exists()


def test_a_file_that_is_not_arrays_is_refused_without_running_it(tmp_path):
    directory = tmp_path / "cifar-10-batches-py"
    write_cifar(directory)
    with open(directory / "data_batch_1", "wb") as file:
        pickle.dump({b"data": Path("/")}, file, protocol=2)  # a class CIFAR never holds
    with pytest.raises(ValueError, match="refusing to load pathlib"):
        read(directory, CIFAR10)


def test_resnet20_trains_on_two_workers(cifar10, tmp_path):
    """A real run: ResNet-20 with batch norm on the generated set, 2 workers, 3 steps, with
    warm-up; the batch-norm statistics are averaged with the model (equal on both workers)."""
    directory, _ = cifar10
    spec = write_spec(tmp_path, f"""
        experiments:
          - name: resnet20
            task: {{name: cifar10_resnet, depth: 20, data_dir: {directory}}}
            workers: 2
            epochs: 1
            batch_size: 8
            log_interval: 1
            optimizer: {{name: sgd, lr: 0.05, momentum: 0.9}}
            lr_schedule: {{name: step, warmup_steps: 2, milestones: [2]}}
            save_dir: {tmp_path / "models"}
          - name: plain
            task: {{name: cifar10_resnet, depth: 20, data_dir: {directory}, augment: false}}
            workers: 2
            epochs: 1
            batch_size: 8
            log_interval: 1
            optimizer: {{name: sgd, lr: 0.05, momentum: 0.9}}
    """)
    assert load_spec(spec)[0].config["task"]["data_dir"] == str(directory.resolve())
    assert load_spec(spec)[1].config["task"]["augment"] is False
    result = dsgd_in_process("run", str(spec), "--db", str(tmp_path / "r.db"))
    assert result.returncode == 0, result.stdout + result.stderr
    store = Store(str(tmp_path / "r.db"))
    runs = {r.experiment: r for r in store.runs()}
    run, plain = runs["resnet20"], runs["plain"]
    # The same model, data order and batch at step 1: only the augmentation differs.
    first_loss = [[m.value for m in store.metric_history(r.id, "train_loss") if m.step == 1]
                  for r in (run, plain)]
    assert first_loss[0] != first_loss[1]
    steps = sorted({m.step for m in store.metric_history(run.id, "train_loss")})
    assert steps == [1, 2, 3]  # 40 images / 2 workers / batch 8 = 3 steps per epoch
    assert [m.value for m in store.metric_history(run.id, "lr") if m.rank == 0] == \
        pytest.approx([0.025, 0.05, 0.005])
    accuracy = [m.value for m in store.metric_history(run.id, "test_accuracy")]
    assert len(accuracy) == 1 and 0 <= accuracy[0] <= 1
    models = [torch.load(tmp_path / "models" / "resnet20" / f"rank{r}.pt") for r in (0, 1)]
    assert torch.equal(models[0]["bn.running_mean"], models[1]["bn.running_mean"])
    assert models[0]["bn.running_mean"].abs().sum() > 0  # the statistics did move
