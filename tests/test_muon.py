"""The `muon` optimizer (issue 50): torch.optim.Muon for the hidden 2-D weights, torch.optim.AdamW
for every other parameter, in one optimizer; and MuLoCo (`diloco` with inner `muon`) in a spec."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from conftest import write_spec
from dsgd_cli.spec.experiments import load_spec

STEPS = 6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 6), nn.LayerNorm(6),
                         nn.Linear(6, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(16, 5, generator=generator), torch.randint(0, 3, (16,), generator=generator)


def _train(model: nn.Module, optimizers: list[torch.optim.Optimizer], steps: int = STEPS,
           rates=None, start: int = 0) -> None:
    """`steps` steps of cross-entropy; `rates(step)`: a factor on every group's base rate,
    as a schedule sets it."""
    for step in range(start, start + steps):
        x, y = _batch(step)
        for optimizer in optimizers:
            optimizer.zero_grad()
            if rates is not None:
                for group in optimizer.param_groups:
                    group.setdefault("base_lr", group["lr"])
                    group["lr"] = group["base_lr"] * rates(step)
        nn.functional.cross_entropy(model(x), y).backward()
        for optimizer in optimizers:
            optimizer.step()


OPTIONS = dict(lr=0.02, momentum=0.9, weight_decay=0.05, adamw_lr=0.003, adamw_beta1=0.8,
               adamw_beta2=0.95, adamw_eps=1e-6, adamw_weight_decay=0.02)


def _plugin(**options) -> torch.optim.Optimizer:
    from plugins.optimizers import Muon

    return Muon, {**OPTIONS, **options}


def _torchs(model: nn.Module, first: int = 1, last: int = 1, **overrides):
    """The reference: torch's own Muon over the chosen matrices and AdamW over the rest; by
    default, as Muon's authors split a model, the first 2-D weight (the input layer) and the
    last (the output layer) on AdamW with every vector, the hidden ones on Muon."""
    o = {**OPTIONS, **overrides}
    matrices = [p for p in model.parameters() if p.ndim == 2]
    to_adamw = matrices[:first] + (matrices[len(matrices) - last:] if last else [])
    hidden = [p for p in matrices if all(p is not q for q in to_adamw)]
    others = [p for p in model.parameters() if all(p is not q for q in hidden)]
    muon = [torch.optim.Muon(hidden, lr=o["lr"], momentum=o["momentum"], nesterov=True,
                             weight_decay=o["weight_decay"])] if hidden else []
    return muon + [torch.optim.AdamW(others, lr=o["adamw_lr"], betas=(o["adamw_beta1"], o["adamw_beta2"]),
                              eps=o["adamw_eps"], weight_decay=o["adamw_weight_decay"])]


def _ours(model: nn.Module, **options) -> torch.optim.Optimizer:
    cls, values = _plugin(**options)
    return cls(cls.Options(**values)).build([p for p in model.parameters()])


def _assert_equal(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("split", [{}, dict(adamw_first=0, adamw_last=0),
                                   dict(adamw_first=2, adamw_last=0)],
                         ids=["default", "all-matrices-on-muon", "first-2"])
def test_muon_equals_torchs_muon_and_adamw(split):
    """By default the hidden Linear(8, 6) alone takes Muon."""
    ours, reference = _model(), _model()
    _train(ours, [_ours(ours, **split)])
    _train(reference, _torchs(reference, split.get("adamw_first", 1), split.get("adamw_last", 1)))
    _assert_equal(ours, reference)
    assert not torch.allclose(next(ours.parameters()), next(_model().parameters()))


def test_muon_differs_from_adamw_on_the_matrices():
    """The matrices really take Muon's orthogonalised step: all-AdamW is another model."""
    ours, adamw = _model(), _model()
    optimizer = _ours(ours)
    kinds = {id(p): group["kind"] for group in optimizer.param_groups for p in group["params"]}
    assert [kinds[id(p)] for p in ours.parameters()] == ["adamw"] * 2 + ["muon"] + ["adamw"] * 5
    # the input layer, the hidden layer, the LayerNorm's weight and bias (vectors), the output layer
    _train(ours, [optimizer])
    _train(adamw, _torchs(adamw, first=3))
    assert not torch.allclose(ours[2].weight, adamw[2].weight, atol=1e-3)


def test_muon_keeps_each_groups_rate_under_a_schedule():
    ours, reference = _model(), _model()
    rates = lambda step: 1.0 / (1 + step)  # noqa: E731
    optimizer = _ours(ours)
    assert [group["lr"] for group in optimizer.param_groups] == [0.02, 0.003]
    _train(ours, [optimizer], rates=rates)
    _train(reference, _torchs(reference), rates=rates)
    _assert_equal(ours, reference)


def test_muon_resumes_from_its_state_dict():
    """Three steps, save, a fresh optimizer loads the state, three more: as six in a row."""
    whole, resumed = _model(), _model()
    _train(whole, [_ours(whole)], steps=6)
    optimizer = _ours(resumed)
    _train(resumed, [optimizer], steps=3)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    optimizer = _ours(resumed)
    optimizer.load_state_dict(torch.load(buffer, weights_only=True))
    _train(resumed, [optimizer], steps=3, start=3)
    _assert_equal(resumed, whole)


def test_muon_puts_embeddings_and_the_output_layer_on_adamw_by_default():
    """A language model's shape: token table, hidden weight, output layer. By default only the
    hidden weight takes Muon; the options move the split (text_lm sets adamw_first 2 for its
    two tables and adamw_last 0, its output layer being its token table)."""
    lm = nn.ModuleDict(dict(embedding=nn.Embedding(11, 6), hidden=nn.Linear(6, 6), output=nn.Linear(6, 11)))
    kinds = lambda optimizer: {id(p): group["kind"] for group in optimizer.param_groups  # noqa: E731
                               for p in group["params"]}
    default = kinds(_ours(lm))
    assert [default[id(p)] for p in (lm.embedding.weight, lm.hidden.weight, lm.output.weight)] == [
        "adamw", "muon", "adamw"]
    moved = kinds(_ours(lm, adamw_first=2, adamw_last=0))
    assert [moved[id(p)] for p in (lm.embedding.weight, lm.hidden.weight, lm.output.weight)] == [
        "adamw", "adamw", "muon"]


def test_muon_without_matrices_or_without_others():
    """A model of vectors only (all AdamW) or of one matrix only (all Muon, with no matrix
    set aside: by default a lone matrix is the input and output layer, on AdamW) builds and steps."""
    for param in (torch.zeros(3, requires_grad=True), torch.ones(2, 3, requires_grad=True)):
        before = param.detach().clone()
        cls, values = _plugin(adamw_first=0, adamw_last=0)
        optimizer = cls(cls.Options(**values)).build([param])
        assert [group["kind"] for group in optimizer.param_groups] == (
            ["muon"] if param.ndim == 2 else ["adamw"])
        param.grad = torch.ones_like(param)
        optimizer.step()
        assert not torch.equal(param.detach(), before)


MULOCO = """
defaults:
  task: {name: logreg, features: 4}
  workers: 2
experiments:
  - name: muloco
    optimizer: {name: muon, lr: 0.02}
    aggregator: {name: diloco, period: 4}
"""


def test_muloco_is_diloco_with_inner_muon(tmp_path):
    config = load_spec(write_spec(tmp_path, MULOCO))[0].config
    assert config["optimizer"]["name"] == "muon" and config["optimizer"]["lr"] == 0.02
    assert config["aggregator"]["name"] == "diloco"
