"""`text_lm` on generated text: the parameter count matches its formula, the split is by
position into side-by-side windows, the model is causal, bad files are one line and exit 2,
and real runs (with `synthetic` in the same launch) record loss, perplexity and accuracy."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import dsgd_in_process, write_spec
from dsgd_cli.spec.experiments import build_plugin, load_spec
from dsgd_cli.results.store import Store
from plugins.tasks.text_lm import lm_params

TEXT = "".join(f"line {i}: the quick brown fox — ça va? {i * i}\n" for i in range(200))


def make_task(tmp_path, text=TEXT, **options):
    path = tmp_path / "text.txt"
    path.write_text(text, encoding="utf-8")
    items = ", ".join(f"{k}: {v}" for k, v in options.items())
    spec = write_spec(tmp_path, f"""
        experiments:
          - {{name: a, workers: 1, task: {{name: text_lm, path: {path}, {items}}}}}
    """)
    return build_plugin("task", load_spec(spec)[0].config["task"])


@pytest.mark.parametrize("options", [
    {"level": "byte", "layers": 2, "width": 32, "heads": 4, "context": 16},
    {"level": "char", "layers": 3, "width": 24, "heads": 2, "context": 8},
    {"level": "char", "layers": 1, "width": 8, "heads": 8, "context": 32}])
def test_parameter_count_matches_the_formula(tmp_path, options):
    task = make_task(tmp_path, **options)
    vocab = 256 if options["level"] == "byte" else len(set(TEXT))
    assert task.vocabulary() == vocab
    model = task.build_model()
    expected = lm_params(vocab, options["context"], options["layers"], options["width"])
    assert sum(p.numel() for p in model.parameters()) == expected


@pytest.mark.parametrize("level", ["byte", "char"])
def test_split_by_position_into_shifted_windows(tmp_path, level):
    task = make_task(tmp_path, level=level, context=10, test_fraction=0.25)
    data = task.load_data(0)
    if level == "byte":
        tokens = list(TEXT.encode("utf-8"))
    else:
        alphabet = sorted(set(TEXT))
        tokens = [alphabet.index(c) for c in TEXT]
    split = len(tokens) - int(len(tokens) * 0.25)
    train, test = tokens[:split], tokens[split:]
    assert len(data.train_x) == (len(train) - 1) // 10 == task.train_examples()
    assert data.train_x[3].tolist() == train[30:40]
    assert data.train_y[3].tolist() == train[31:41]
    assert data.test_x[0].tolist() == test[:10] and data.test_y[0].tolist() == test[1:11]
    assert len(data.test_x) == (len(test) - 1) // 10


def test_the_model_is_causal(tmp_path):
    """Changing token t changes no prediction before t."""
    torch.manual_seed(0)
    model = make_task(tmp_path, width=16, heads=2, context=12).build_model()
    tokens = torch.randint(0, 256, (2, 12))
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 256
    out, out_changed = model(tokens), model(changed)
    assert torch.allclose(out[:, :7], out_changed[:, :7], atol=1e-6)
    assert not torch.allclose(out[:, 7:], out_changed[:, 7:])


def test_loss_and_accuracy_are_per_token(tmp_path):
    task = make_task(tmp_path, width=16, heads=2, context=4)
    target = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    output = torch.full((2, 4, 256), -10.0)
    output[0, torch.arange(4), target[0]] = 10.0  # example 0 all right
    output[1, 0, 5] = 10.0                         # example 1: one token of four right
    output[1, 1:, 0] = 10.0
    assert task.count_correct(output, target) == pytest.approx(1.25)
    expected = torch.nn.functional.cross_entropy(output.reshape(8, 256), target.reshape(8))
    assert float(task.loss(output, target)) == pytest.approx(float(expected))


def test_bad_text_files_are_one_line_and_exit_2(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1") * 100)
    (tmp_path / "short.txt").write_text("tiny\n")
    (tmp_path / "dir").mkdir()
    for path, extra, message in [
            (tmp_path / "missing.txt", "", f"path: cannot read {tmp_path / 'missing.txt'}: No such file"),
            (tmp_path / "dir", "", f"path: {tmp_path / 'dir'} is not a file"),
            (tmp_path / "latin1.txt", "", f"path: {tmp_path / 'latin1.txt'} is not UTF-8 text "
                                          f"(byte 0xe9 at offset 3)"),
            (tmp_path / "short.txt", "", f"path: {tmp_path / 'short.txt'} is too short"),
            (tmp_path / "latin1.txt", ", level: char, width: 30, heads: 4",
             "width: 30 is not a multiple of heads (4)")]:
        spec = write_spec(tmp_path, f"""
            experiments:
              - {{name: a, task: {{name: text_lm, path: {path}{extra}}}}}
        """)
        result = dsgd_in_process("run", str(spec), "--db", str(tmp_path / "r.db"))
        assert result.returncode == 2, result.stderr
        assert f"{spec}: experiments[0].task: {message}" in result.stderr, result.stderr
        assert len(result.stderr.splitlines()) == 1
        assert not (tmp_path / "r.db").exists()
    spec = write_spec(tmp_path, "experiments: [{name: a, task: text_lm}]")
    result = dsgd_in_process("run", str(spec))
    assert result.returncode == 2
    assert "experiments[0].task.path: required option missing (a string)" in result.stderr


def test_text_lm_and_synthetic_train_in_real_runs(tmp_path):
    (tmp_path / "text.txt").write_text(TEXT * 3, encoding="utf-8")
    spec = write_spec(tmp_path, f"""
        defaults: {{workers: 2, epochs: 1, batch_size: 8, steps_per_epoch: 4, log_interval: 2,
                   optimizer: {{name: adam, lr: 0.003}}}}
        experiments:
          - name: lm
            task: {{name: text_lm, path: {tmp_path / "text.txt"}, level: char, layers: 1,
                   width: 16, heads: 2, context: 16}}
            lr_schedule: {{name: cosine, warmup_steps: 1}}
          - name: synthetic
            task: {{name: synthetic, params: 20k, samples: 256}}
            aggregator: {{name: local_sgd, period: 2}}
    """)
    result = dsgd_in_process("run", str(spec), "--db", str(tmp_path / "r.db"))
    assert result.returncode == 0, result.stdout + result.stderr
    store = Store(str(tmp_path / "r.db"))
    runs = {run.experiment: run for run in store.runs()}
    assert {run.status for run in runs.values()} == {"completed"}
    lm = runs["lm"].id
    (loss,) = [m.value for m in store.metric_history(lm, "test_loss")]
    (perplexity,) = [m.value for m in store.metric_history(lm, "test_perplexity")]
    (accuracy,) = [m.value for m in store.metric_history(lm, "test_accuracy")]
    assert perplexity == pytest.approx(math.exp(loss))
    assert 0 <= accuracy <= 1 and 0 < loss < math.log(256)
    assert sorted({m.step for m in store.metric_history(lm, "train_loss")}) == [2, 4]
    synthetic = runs["synthetic"].id
    assert len(store.metric_history(synthetic, "test_accuracy")) == 1
    assert store.metric_history(synthetic, "test_perplexity") == []


def test_a_relative_path_is_looked_up_in_dsgd_data(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "corpus.txt").write_text(TEXT)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setenv("DSGD_DATA", str(tmp_path / "data"))
    spec = write_spec(tmp_path, "experiments: [{name: a, task: {name: text_lm, path: corpus.txt}}]")
    assert load_spec(spec)[0].config["task"]["path"] == str(tmp_path / "data" / "corpus.txt")
    (tmp_path / "cwd" / "corpus.txt").write_text(TEXT)  # the working directory comes first
    assert load_spec(spec)[0].config["task"]["path"] == str(tmp_path / "cwd" / "corpus.txt")


def test_a_name_too_long_for_the_system_is_one_line_and_exit_2(tmp_path, monkeypatch):
    """With $DSGD_DATA set, a relative path is looked for there too: a name longer than the
    system takes (found by tests/test_fuzz.py) made that look-up raise a traceback."""
    monkeypatch.setenv("DSGD_DATA", str(tmp_path))
    name = "x" * 300
    spec = write_spec(tmp_path, f"experiments: [{{name: a, task: {{name: text_lm, path: {name}}}}}]")
    result = dsgd_in_process("run", str(spec), "--db", str(tmp_path / "r.db"))
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.splitlines()) == 1
    assert "experiments[0].task: path: cannot read" in result.stderr
    assert "name too long" in result.stderr
