"""The low-communication family (issue 35): nested optimizer sections in plugin options, the
`adamw`, `lamb` and `lars` optimizers, and the `diloco`, `streaming_diloco` and `slowmo`
aggregators, each checked against its definition.

The aggregators run in 2 gloo worker processes driven by a hand-written loop (one start of the
workers runs every scenario), with gradients under the test's control; their models are
compared with references written from the definitions, simulated in one process.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from conftest import dsgd_in_process, write_spec
from distributed import run_workers
from dsgd_cli.api import Comm, WorkerContext, flatten
from dsgd_cli.spec.experiments import load_spec

WORKERS = 2


# -- nested optimizer sections --------------------------------------------------------------

DILOCO_SPEC = """
defaults:
  task: {{name: logreg, features: 4}}
  workers: 2
experiments:
  - name: a
    aggregator: {aggregator}
"""

PAPER_OUTER = {"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True, "weight_decay": 0.0}


def _aggregator_config(tmp_path, aggregator: str) -> dict:
    spec = write_spec(tmp_path, DILOCO_SPEC.format(aggregator=aggregator))
    return load_spec(spec)[0].config["aggregator"]


def test_outer_optimizer_default_is_the_papers_with_every_option_filled_in(tmp_path):
    config = _aggregator_config(tmp_path, "{name: diloco, period: 4}")
    assert config["outer_optimizer"] == PAPER_OUTER


@pytest.mark.parametrize("section, expected", [
    ("{name: adamw, lr: 0.01}", {"name": "adamw", "lr": 0.01, "beta1": 0.9, "beta2": 0.999,
                                 "eps": 1e-8, "weight_decay": 0.01}),
    ("adam", {"name": "adam", "lr": 0.001, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
              "weight_decay": 0.0}),
    ("{name: sgd, lr: 1.0}", {"name": "sgd", "lr": 1.0, "momentum": 0.0, "nesterov": False,
                              "weight_decay": 0.0}),
])
def test_outer_optimizer_is_any_registered_optimizer(tmp_path, section, expected):
    config = _aggregator_config(tmp_path, f"{{name: diloco, outer_optimizer: {section}}}")
    assert config["outer_optimizer"] == expected


def _builtin_optimizers() -> list[str]:
    from dsgd_cli.spec import registry

    return sorted(name for name, entry in registry.discover("optimizer").items()
                  if entry.distribution == "dsgd")


@pytest.mark.parametrize("name", _builtin_optimizers())
def test_every_registered_optimizer_can_be_the_outer_one(tmp_path, name):
    from dataclasses import asdict

    from dsgd_cli.spec import registry

    config = _aggregator_config(tmp_path, f"{{name: diloco, outer_optimizer: {{name: {name}}}}}")
    options = registry.load("optimizer", name).Options()
    assert config["outer_optimizer"] == {"name": name, **asdict(options)}


@pytest.mark.parametrize("section, expected", [
    ("{name: sgd, lr: -1}", "experiments[0].aggregator.outer_optimizer.lr: expected a value >= 0.0, got -1"),
    ("{name: sgd, lr: .nan}", "experiments[0].aggregator.outer_optimizer.lr: expected a finite number"),
    ("{name: sgd, momentum: 0.9, nesterof: true}",
     "experiments[0].aggregator.outer_optimizer.nesterof: unknown option 'nesterof'"),
    ("{name: sgdd}", "experiments[0].aggregator.outer_optimizer.name: unknown optimizer 'sgdd'"),
    ("{name: sgd, nesterov: true}",
     "experiments[0].aggregator.outer_optimizer: nesterov: true needs momentum > 0"),
    ("3", "experiments[0].aggregator.outer_optimizer: expected a mapping with a 'name' key, got 3"),
    ("{lr: 0.7}", "experiments[0].aggregator.outer_optimizer.name: expected the name of a optimizer plugin"),
])
def test_bad_outer_optimizer_exits_2_naming_the_key_path(tmp_path, section, expected):
    spec = write_spec(tmp_path, DILOCO_SPEC.format(
        aggregator=f"{{name: diloco, outer_optimizer: {section}}}"))
    result = dsgd_in_process("run", str(spec), "--dry-run")
    assert result.returncode == 2, result.stderr
    message = result.stderr.strip()
    assert "\n" not in message and message.startswith(f"dsgd: error: {spec}: "), message
    assert expected in message, message


def test_slowmo_base_is_a_nested_aggregator_section(tmp_path):
    config = _aggregator_config(tmp_path, "{name: slowmo}")
    assert config["base"] == {"name": "local_sgd", "period": 3, "error_feedback": False,
                              "sync_buffers": True}
    assert (config["period"], config["slow_momentum"], config["slow_lr"]) == (48, 0.5, 1.0)


@pytest.mark.parametrize("aggregator, expected", [
    ("{name: slowmo, base: {name: local_sgd, period: 0}}",
     "experiments[0].aggregator.base.period: expected a value >= 1, got 0"),
    ("{name: slowmo, base: {name: dpsgd}}",
     "experiments[0].aggregator: base: expected an aggregator among local_sgd, sgp, got 'dpsgd'"),
    ("{name: slowmo, slow_momentum: 1.5}",
     "experiments[0].aggregator.slow_momentum: expected a value <= 1.0, got 1.5"),
])
def test_bad_slowmo_exits_2_naming_the_key_path(tmp_path, aggregator, expected):
    spec = write_spec(tmp_path, DILOCO_SPEC.format(aggregator=aggregator))
    result = dsgd_in_process("run", str(spec), "--dry-run")
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr, result.stderr


def test_slowmo_checks_its_bases_graph():
    from plugins.aggregators.slowmo import SlowMo

    base = {"name": "sgp", "topology": "hypercube", "peers_per_step": 1,
            "error_feedback": False, "sync_buffers": True}
    SlowMo.check_world(SlowMo.Options(base=base), 4)
    with pytest.raises(ValueError, match="hypercube"):
        SlowMo.check_world(SlowMo.Options(base=base), 3)


def test_adamw_decouples_weight_decay():
    """One step from zero moments: Adam's update is lr·sign(g) (up to eps); AdamW first
    shrinks x by lr·wd·x, whatever the gradient."""
    from plugins.optimizers import AdamW

    x = torch.tensor([2.0, -1.0], dtype=torch.float64, requires_grad=True)
    optimizer = AdamW(AdamW.Options(lr=0.1, weight_decay=0.5, eps=0.0)).build([x])
    x.grad = torch.tensor([3.0, 0.5], dtype=torch.float64)
    optimizer.step()
    expected = torch.tensor([2.0, -1.0]) * (1 - 0.1 * 0.5) - 0.1 * torch.tensor([1.0, 1.0])
    assert torch.allclose(x.detach(), expected.double(), atol=1e-12)


def _two_layers() -> list[torch.Tensor]:
    """Layer 1: x = (3, 4), ‖x‖ = 5; layer 2: x = (−1)."""
    return [torch.tensor([3.0, 4.0], dtype=torch.float64, requires_grad=True),
            torch.tensor([-1.0], dtype=torch.float64, requires_grad=True)]


def test_lamb_trust_ratio_on_a_hand_computed_two_layer_example():
    """First step (eps 0, which only the optimizer class itself accepts): the bias-corrected moments give r = sign(g) = (1, −1) and (1);
    with λ = 0.1, r + λx = (1.3, −0.6), ‖·‖ = √2.05, and (0.9): trust ratios 5/√2.05 and
    1/0.9, so layer 2 moves by exactly lr = 0.01."""
    from plugins.optimizers import LAMBOptimizer

    layers = _two_layers()
    optimizer = LAMBOptimizer(layers, lr=0.01, betas=(0.9, 0.999), eps=0.0, weight_decay=0.1)
    layers[0].grad = torch.tensor([1.0, -2.0], dtype=torch.float64)
    layers[1].grad = torch.tensor([0.5], dtype=torch.float64)
    optimizer.step()
    root = 2.05 ** 0.5
    assert layers[0].detach().tolist() == pytest.approx(
        [3 - 0.01 * 5 / root * 1.3, 4 + 0.01 * 5 / root * 0.6], abs=1e-15)
    assert layers[1].detach().tolist() == pytest.approx([-1.01], abs=1e-15)


def test_lamb_second_step_uses_the_bias_corrected_moments():
    from plugins.optimizers import LAMBOptimizer

    x = torch.tensor([3.0, 4.0], dtype=torch.float64, requires_grad=True)
    optimizer = LAMBOptimizer([x], lr=0.01, betas=(0.5, 0.75), eps=0.0, weight_decay=0.0)
    x.grad = torch.tensor([1.0, -2.0], dtype=torch.float64)
    optimizer.step()
    after_first = x.detach().clone()
    x.grad = torch.tensor([3.0, 2.0], dtype=torch.float64)
    optimizer.step()
    # m = 0.5·(0.5·(1, −2)) + 0.5·(3, 2) = (1.75, 0.5), m̂ = m / 0.75 = (7/3, 2/3);
    # v = 0.75·0.25·(1, 4) + 0.25·(9, 4) = (2.4375, 1.75), v̂ = v / 0.4375 = (39/7, 4)
    r = torch.tensor([(7 / 3) / (39 / 7) ** 0.5, (2 / 3) / 2], dtype=torch.float64)
    expected = after_first - 0.01 * after_first.norm() / r.norm() * r
    assert torch.allclose(x.detach(), expected, rtol=0, atol=1e-15)


def test_lamb_adds_eps_to_the_bias_corrected_root():
    """First step, eps 0.1 and |g| small next to it: m̂ = g, √v̂ = |g|, so r = g / (|g| + eps)
    = (0.01/0.11, −0.02/0.12); eps under the root, or before the bias correction, is far
    from that."""
    from plugins.optimizers import LAMB

    x = torch.tensor([3.0, 4.0], dtype=torch.float64, requires_grad=True)
    optimizer = LAMB(LAMB.Options(lr=0.01, eps=0.1, weight_decay=0.0)).build([x])
    x.grad = torch.tensor([0.01, -0.02], dtype=torch.float64)
    optimizer.step()
    r = [0.01 / 0.11, -0.02 / 0.12]
    ratio = 5 / math.hypot(*r)
    assert x.detach().tolist() == pytest.approx([3 - 0.01 * ratio * r[0], 4 - 0.01 * ratio * r[1]],
                                                rel=1e-12)


def test_lamb_takes_the_plain_step_where_the_weights_are_zero():
    """‖x‖ = 0 (a zero-initialised bias): the trust ratio is 1, x ← −lr·r, not ‖x‖/‖r‖ = 0."""
    from plugins.optimizers import LAMB

    x = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    optimizer = LAMB(LAMB.Options(lr=0.1, eps=0.5, weight_decay=0.3)).build([x])
    x.grad = torch.tensor([1.0, -2.0], dtype=torch.float64)
    optimizer.step()
    assert x.detach().tolist() == pytest.approx([-0.1 * 1 / 1.5, 0.1 * 2 / 2.5], rel=1e-12)


def test_lars_momentum_holds_the_scaled_step_when_the_rate_changes():
    """γ = 0.5, then 2.0 (a schedule): the paper's v ← m v + γ λ (g + βx), x ← x − v keeps
    the first step's γ inside v; the form that scales v by the current γ (x ← x − γ v, as
    LARC/apex and torch's SGD do) gives another second step."""
    from plugins.optimizers import LARS

    x = torch.tensor([3.0, 4.0], dtype=torch.float64, requires_grad=True)
    optimizer = LARS(LARS.Options(lr=0.5, momentum=0.9, weight_decay=0.1,
                                  trust_coefficient=0.001)).build([x])

    def local_rate(weights: list[float], gradient: list[float]) -> float:
        return 0.001 * math.hypot(*weights) / (math.hypot(*gradient) + 0.1 * math.hypot(*weights))

    g1, g2 = [1.0, -2.0], [0.5, 3.0]
    x.grad = torch.tensor(g1, dtype=torch.float64)
    optimizer.step()
    x0 = [3.0, 4.0]
    v1 = [0.5 * local_rate(x0, g1) * (g + 0.1 * w) for g, w in zip(g1, x0)]
    x1 = [w - v for w, v in zip(x0, v1)]
    assert x.detach().tolist() == pytest.approx(x1, rel=1e-13)
    optimizer.param_groups[0]["lr"] = 2.0
    x.grad = torch.tensor(g2, dtype=torch.float64)
    optimizer.step()
    v2 = [0.9 * v + 2.0 * local_rate(x1, g2) * (g + 0.1 * w) for v, g, w in zip(v1, g2, x1)]
    assert x.detach().tolist() == pytest.approx([w - v for w, v in zip(x1, v2)], rel=1e-13)


OPTIMIZER_SPEC = """
defaults:
  task: {{name: logreg, features: 4}}
  workers: 2
experiments:
  - name: a
    optimizer: {optimizer}
"""


@pytest.mark.parametrize("section, expected", [
    ("{name: adam, beta1: 1.0}", "experiments[0].optimizer: beta1: expected a value < 1, got 1.0"),
    ("{name: adam, beta2: 1}", "experiments[0].optimizer: beta2: expected a value < 1, got 1"),
    ("{name: adamw, beta1: 1.0}", "experiments[0].optimizer: beta1: expected a value < 1, got 1.0"),
    ("{name: adamw, beta2: 1.0}", "experiments[0].optimizer: beta2: expected a value < 1, got 1.0"),
    ("{name: lamb, beta1: 1.0}", "experiments[0].optimizer: beta1: expected a value < 1, got 1.0"),
    ("{name: lamb, beta2: 1.0}", "experiments[0].optimizer: beta2: expected a value < 1, got 1.0"),
    ("{name: lamb, eps: 0}", "experiments[0].optimizer: eps: expected a value > 0, got 0"),
    ("{name: lars, trust_coefficient: 0.0}",
     "experiments[0].optimizer: trust_coefficient: expected a value > 0, got 0.0"),
])
def test_bad_optimizer_bounds_exit_2_naming_the_key_path(tmp_path, section, expected):
    spec = write_spec(tmp_path, OPTIMIZER_SPEC.format(optimizer=section))
    result = dsgd_in_process("run", str(spec), "--dry-run")
    assert result.returncode == 2, result.stderr
    message = result.stderr.strip()
    assert "\n" not in message and message.startswith(f"dsgd: error: {spec}: "), message
    assert expected in message, message


def test_bad_outer_optimizer_bound_names_the_nested_key_path(tmp_path):
    spec = write_spec(tmp_path, DILOCO_SPEC.format(
        aggregator="{name: diloco, outer_optimizer: {name: lamb, beta1: 1.0}}"))
    result = dsgd_in_process("run", str(spec), "--dry-run")
    assert result.returncode == 2, result.stderr
    assert ("experiments[0].aggregator.outer_optimizer: beta1: expected a value < 1, got 1.0"
            in result.stderr), result.stderr


@pytest.mark.parametrize("name, options", [
    ("adam", {"beta1": 0.0, "beta2": 0.0}), ("adamw", {"beta1": 0.99, "beta2": 0.9999}),
    ("lamb", {"eps": 1e-12, "beta1": 0.0}), ("lars", {"trust_coefficient": 1e-9})])
def test_optimizer_bounds_accept_values_just_inside(name, options):
    from dsgd_cli.spec import registry

    cls = registry.load("optimizer", name)
    cls(cls.Options(**options)).build([torch.zeros(1, requires_grad=True)])


def test_lars_local_rates_on_a_hand_computed_two_layer_example():
    """γ = 1, η = 0.001, β = 0.1, momentum 0.9. Layer 1: λ = 0.001·5 / (√5 + 0.5),
    g + βx = (1.3, −1.6). Layer 2 has zero weights: the plain step, λ = 1. A second step adds
    the momentum: v ← 0.9 v + γ λ (g + βx)."""
    from plugins.optimizers import LARS

    layers = [torch.tensor([3.0, 4.0], dtype=torch.float64, requires_grad=True),
              torch.tensor([0.0], dtype=torch.float64, requires_grad=True)]
    optimizer = LARS(LARS.Options(lr=1.0, momentum=0.9, weight_decay=0.1,
                                  trust_coefficient=0.001)).build(layers)
    layers[0].grad = torch.tensor([1.0, -2.0], dtype=torch.float64)
    layers[1].grad = torch.tensor([0.5], dtype=torch.float64)
    optimizer.step()
    local = 0.005 / (5 ** 0.5 + 0.5)
    v1 = [local * 1.3, local * -1.6]
    x1 = [3 - v1[0], 4 - v1[1]]
    assert layers[0].detach().tolist() == pytest.approx(x1, abs=1e-15)
    assert layers[1].detach().tolist() == [-0.5]
    layers[0].grad = torch.tensor([0.0, 1.0], dtype=torch.float64)
    layers[1].grad = None
    optimizer.step()
    norm = (x1[0] ** 2 + x1[1] ** 2) ** 0.5
    local = 0.001 * norm / (1.0 + 0.1 * norm)
    v2 = [0.9 * v1[0] + local * 0.1 * x1[0], 0.9 * v1[1] + local * (1 + 0.1 * x1[1])]
    assert layers[0].detach().tolist() == pytest.approx([x1[0] - v2[0], x1[1] - v2[1]], abs=1e-15)
    assert layers[1].detach().tolist() == [-0.5]


# -- the in-process harness -------------------------------------------------------------------

class _Metrics:
    def __init__(self):
        self.values: dict[str, list[float]] = {}

    def log(self, name, value):
        self.values.setdefault(name, []).append(float(value))


def _model(dtype=torch.float64) -> nn.Module:
    """Two layers; the same initial parameters on every worker."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1)).to(dtype)


def _gradients(model: nn.Module, rank: int, step: int) -> list[torch.Tensor]:
    """A known gradient per rank and step, which depends on the parameters too (so the
    inner optimizer's path matters): g = p · (1 + rank) / 4 + sin(step + index)."""
    return [p.detach() * (1 + rank) / 4 + torch.sin(torch.arange(p.numel(), dtype=p.dtype)
                                                   + step).view_as(p)
            for p in model.parameters()]


def _context(rank: int, n: int, inner, dtype=torch.float64) -> WorkerContext:
    model = _model(dtype)
    return WorkerContext(rank=rank, world_size=n, device=torch.device("cpu"), model=model,
                         optimizer=inner(model.parameters()), comm=Comm(rank, n),
                         metrics=_Metrics(), seed=0, compressor=None, config={})


def _step(aggregator, ctx, step: int, lr: float | list[float] | None = None) -> None:
    """One step in the runtime's order, with the gradient (and `lr`, one for every param
    group or a list of one per group) set by the test."""
    if lr is not None:
        groups = ctx.optimizer.param_groups
        for group, rate in zip(groups, lr if isinstance(lr, list) else [lr] * len(groups)):
            group["lr"] = rate
    ctx.optimizer.zero_grad(set_to_none=True)
    aggregator.before_forward(step)
    for p, g in zip(ctx.model.parameters(), _gradients(ctx.model, ctx.rank, step)):
        p.grad = g
    aggregator.after_backward(step)
    ctx.optimizer.step()
    aggregator.after_step(step)


def _flat(model: nn.Module) -> torch.Tensor:
    return flatten([p.detach() for p in model.parameters()]).clone()


def _adamw(params):
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


# -- diloco -----------------------------------------------------------------------------------

DILOCO = {"period": 4, "steps": 14, "outer_lr": 0.7, "outer_momentum": 0.9}


def _scenario_diloco(rank, n, compressor=None, error_feedback=False, dtype=torch.float64):
    """Inner AdamW, the paper's outer SGD with Nesterov momentum, H = 4, 14 steps (3 rounds
    and 2 steps after the last); Δ through `compressor` (a built one, or None)."""
    from plugins.aggregators.diloco import DiLoCo

    ctx = _context(rank, n, _adamw, dtype)
    if compressor is not None:
        compressor.setup(ctx)
        ctx.compressor = compressor
    aggregator = DiLoCo(DiLoCo.Options(period=DILOCO["period"], error_feedback=error_feedback))
    aggregator.setup(ctx)
    models, traffic = [], []
    for step in range(DILOCO["steps"]):
        _step(aggregator, ctx, step)
        models.append(_flat(ctx.model))
        traffic.append(ctx.comm.take_traffic().bytes_sent)
    aggregator.finish()
    return {"models": models, "traffic": traffic, "inner_state": _adam_state(ctx.optimizer),
            "rounds": ctx.metrics.values.get("outer_rounds")}


def _adam_state(optimizer) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """(exp_avg, exp_avg_sq, step) of every parameter of an Adam-family optimizer."""
    return [(state["exp_avg"].clone(), state["exp_avg_sq"].clone(), float(state["step"]))
            for state in (optimizer.state[p] for group in optimizer.param_groups
                          for p in group["params"])]


def _scenario_diloco_h1_is_averaging(rank, n):
    """H = 1, outer SGD lr 1 without momentum, next to local SGD with period 1 (model
    averaging after every step), from the same start with the same gradients."""
    from plugins.aggregators.diloco import DiLoCo
    from plugins.aggregators.local_sgd import LocalSGD

    outer = {"name": "sgd", "lr": 1.0, "momentum": 0.0, "nesterov": False, "weight_decay": 0.0}
    runs = {}
    for name, aggregator in [("diloco", DiLoCo(DiLoCo.Options(period=1, outer_optimizer=outer))),
                             ("averaging", LocalSGD(LocalSGD.Options(period=1)))]:
        ctx = _context(rank, n, _sgd)
        aggregator.setup(ctx)
        runs[name] = []
        for step in range(5):
            _step(aggregator, ctx, step)
            runs[name].append(_flat(ctx.model))
    return runs


def _exchanged_exactly(deltas: list[list[torch.Tensor]], residuals) -> list[torch.Tensor]:
    """(1/n) Σ_i Δ_i, per parameter tensor; `deltas[i]` is worker i's."""
    return [sum(tensors) / len(deltas) for tensors in zip(*deltas)]


def _exchanged_in_fp16(deltas, residuals):
    """Each worker's Δ cast to fp16, summed in fp16, divided by n in float64."""
    return [sum(t.half() for t in tensors).double() / len(deltas) for tensors in zip(*deltas)]


TOPK_RATIO = 0.5


def _exchanged_topk_with_error_feedback(deltas, residuals):
    """Per worker and tensor: c = Δ + e; keep the ⌈ratio·d⌉ largest |c|; e ← c − kept."""
    averaged = None
    for rank, tensors in enumerate(deltas):
        kept_tensors = []
        for index, delta in enumerate(tensors):
            compensated = delta + residuals.get((rank, index), torch.zeros_like(delta))
            flat = compensated.reshape(-1)
            k = math.ceil(TOPK_RATIO * flat.numel())
            kept = torch.zeros_like(flat)
            top = flat.abs().topk(k).indices
            kept[top] = flat[top]
            residuals[rank, index] = compensated - kept.view_as(delta)
            kept_tensors.append(kept.view_as(delta))
        averaged = kept_tensors if averaged is None else [a + b for a, b in zip(averaged, kept_tensors)]
    return [a / len(deltas) for a in averaged]


def _reference_diloco(n: int, exchange=_exchanged_exactly, dtype=torch.float64) -> dict:
    """DiLoCo from its definition, n workers simulated in one process: per worker its own
    model and inner AdamW; after steps H, 2H, ...: Δ = (1/n) Σ (θ_global − θ_i) (through
    `exchange`), the outer Nesterov step b ← μ b + Δ, θ_global ← θ_global − lr (Δ + μ b),
    every θ_i ← θ_global."""
    models = [_model(dtype) for _ in range(n)]
    residuals = {}
    inner = [_adamw(m.parameters()) for m in models]
    global_ = _flat(models[0])
    momentum = torch.zeros_like(global_)
    lr, mu = DILOCO["outer_lr"], DILOCO["outer_momentum"]
    history = {rank: [] for rank in range(n)}
    for step in range(DILOCO["steps"]):
        for rank, (model, optimizer) in enumerate(zip(models, inner)):
            optimizer.zero_grad()
            for p, g in zip(model.parameters(), _gradients(model, rank, step)):
                p.grad = g
            optimizer.step()
        if (step + 1) % DILOCO["period"] == 0:
            deltas = [[g - p.detach() for g, p in zip(_split(global_, model), model.parameters())]
                      for model in models]
            delta = flatten(exchange(deltas, residuals))
            momentum = mu * momentum + delta
            global_ = global_ - lr * (delta + mu * momentum)
            for model in models:
                _load(model, global_)
        for rank, model in enumerate(models):
            history[rank].append(_flat(model))
    return {"models": history, "inner_state": {rank: _adam_state(optimizer)
                                               for rank, optimizer in enumerate(inner)}}


def _split(flat: torch.Tensor, model: nn.Module) -> list[torch.Tensor]:
    pieces, offset = [], 0
    for p in model.parameters():
        pieces.append(flat[offset: offset + p.numel()].view_as(p))
        offset += p.numel()
    return pieces


@torch.no_grad()
def _load(model: nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for p in model.parameters():
        p.copy_(flat[offset: offset + p.numel()].view_as(p))
        offset += p.numel()


# -- streaming_diloco -------------------------------------------------------------------------

STREAMING_STEPS = 19  # the last exchange (fragment 0's, sent after step 19 with delay 1) is never applied
STREAMING_CASES = [(8, 2, 0, 0.0), (8, 2, 1, 0.25), (8, 4, 1, 0.0)]  # (H, F, delay, alpha)


def _scenario_streaming(rank, n, period, fragments, delay, alpha):
    from plugins.aggregators.streaming_diloco import StreamingDiLoCo

    ctx = _context(rank, n, _adamw)
    aggregator = StreamingDiLoCo(StreamingDiLoCo.Options(
        period=period, fragments=fragments, delay=delay, alpha=alpha))
    aggregator.setup(ctx)
    models, traffic = [], []
    for step in range(STREAMING_STEPS):
        _step(aggregator, ctx, step)
        models.append(_flat(ctx.model))
        traffic.append(ctx.comm.take_traffic().bytes_sent)
    aggregator.finish()
    return {"models": models, "traffic": traffic,
            "applied": ctx.metrics.values.get("fragment_applied")}


def _scenario_peak_bytes(rank, n):
    """Per-step bytes of diloco and streaming_diloco (F = 2 and 4, delay 1) with H = 8 on a
    model of four equal tensors."""
    from plugins.aggregators.diloco import DiLoCo
    from plugins.aggregators.streaming_diloco import StreamingDiLoCo

    sent = {}
    for fragments in (None, 2, 4):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(2, 2, bias=False) for _ in range(4)]).double()
        ctx = WorkerContext(rank=rank, world_size=n, device=torch.device("cpu"), model=model,
                            optimizer=_sgd(model.parameters()), comm=Comm(rank, n),
                            metrics=_Metrics(), seed=0, compressor=None, config={})
        aggregator = (DiLoCo(DiLoCo.Options(period=8)) if fragments is None else
                      StreamingDiLoCo(StreamingDiLoCo.Options(period=8, fragments=fragments, delay=1)))
        aggregator.setup(ctx)
        sent[fragments] = []
        for step in range(16):
            _step(aggregator, ctx, step)
            sent[fragments].append(ctx.comm.take_traffic().bytes_sent)
        aggregator.finish()
    return sent


def _fragments(model: nn.Module, count: int) -> list[list[int]]:
    """Parameter indices by fragment: numpy's array_split rule, written out."""
    total = len(list(model.parameters()))
    sizes = [total // count + (1 if f < total % count else 0) for f in range(count)]
    starts = [sum(sizes[:f]) for f in range(count)]
    return [list(range(start, start + size)) for start, size in zip(starts, sizes)]


def _reference_streaming(n: int, period: int, fragments: int, delay: int, alpha: float) -> dict:
    """Streaming DiLoCo from its definition, n workers simulated in one process: per worker
    inner AdamW; T = H/F; after step n with n mod T == T − delay (mod T) the fragment of
    segment (n − 1)//T sends Δ = θ_global − θ_local (averaged over the workers); after step n
    with n mod T == 0 it is applied: a Nesterov outer step per fragment (its own momentum),
    then θ_local ← (1 − α) θ_global + α θ_local."""
    models = [_model() for _ in range(n)]
    inner = [_adamw(m.parameters()) for m in models]
    groups = _fragments(models[0], fragments)
    params = [list(m.parameters()) for m in models]
    global_ = [[params[0][i].detach().clone() for i in group] for group in groups]
    momentum = [[torch.zeros_like(g) for g in fragment] for fragment in global_]
    lr, mu = DILOCO["outer_lr"], DILOCO["outer_momentum"]
    segment = period // fragments
    sent = None
    history = {rank: [] for rank in range(n)}
    for step in range(STREAMING_STEPS):
        for rank, (model, optimizer) in enumerate(zip(models, inner)):
            optimizer.zero_grad()
            for p, g in zip(model.parameters(), _gradients(model, rank, step)):
                p.grad = g
            optimizer.step()
        count = step + 1
        fragment = ((count - 1) // segment) % fragments
        if count % segment == (segment - delay) % segment:
            sent = [sum(global_[fragment][j] - params[rank][i].detach() for rank in range(n)) / n
                    for j, i in enumerate(groups[fragment])]
        if count % segment == 0:
            for j, i in enumerate(groups[fragment]):
                momentum[fragment][j] = mu * momentum[fragment][j] + sent[j]
                global_[fragment][j] = global_[fragment][j] - lr * (sent[j] + mu * momentum[fragment][j])
                with torch.no_grad():
                    for rank in range(n):
                        local = params[rank][i].detach().clone()
                        params[rank][i].copy_((1 - alpha) * global_[fragment][j] + alpha * local)
        for rank, model in enumerate(models):
            history[rank].append(_flat(model))
    return history


# -- slowmo -----------------------------------------------------------------------------------

SLOWMO = {"period": 4, "base_period": 3, "steps": 13}


def _slowmo_lr(step: int) -> float:
    """A learning rate that changes every step, so that γ must be the current one."""
    return 0.1 * (1 + step % 3)


def _scenario_slowmo(rank, n, beta: float, alpha: float, base: dict | None = None,
                     period: int = SLOWMO["period"], inner=_sgd, lrs=_slowmo_lr) -> dict:
    """SGD inner steps (`inner`) at the rates `lrs(step)`; local SGD averaging every 3 steps
    (or `base`), slow momentum every `period`. The models and bytes sent after every step."""
    from plugins.aggregators.slowmo import SlowMo

    ctx = _context(rank, n, inner)
    aggregator = SlowMo(SlowMo.Options(
        period=period, slow_momentum=beta, slow_lr=alpha,
        base=base or {"name": "local_sgd", "period": SLOWMO["base_period"]}))
    aggregator.setup(ctx)
    ctx.comm.take_traffic()
    models, traffic = [], []
    for step in range(SLOWMO["steps"]):
        _step(aggregator, ctx, step, lrs(step))
        models.append(_flat(ctx.model))
        traffic.append(ctx.comm.take_traffic().bytes_sent)
    aggregator.finish()
    return {"models": models, "traffic": traffic}


SGP_BASE = {"name": "sgp", "topology": "time_varying_exponential", "peers_per_step": 1,
            "error_feedback": False, "sync_buffers": True}


def _scenario_slowmo_buffers(rank, n) -> list[list[float]]:
    """slowmo with `sync_buffers: false` over local SGD that averages parameters and buffers
    every 2 steps, τ = 4: each worker sets a buffer to rank + step before each step; its
    value after each step."""
    from plugins.aggregators.slowmo import SlowMo

    ctx = _context(rank, n, _sgd)
    ctx.model.register_buffer("statistic", torch.zeros(1, dtype=torch.float64))
    aggregator = SlowMo(SlowMo.Options(period=4, sync_buffers=False,
                                       base={"name": "local_sgd", "period": 2}))
    aggregator.setup(ctx)
    values = []
    for step in range(4):
        ctx.model.statistic.fill_(rank + step)
        _step(aggregator, ctx, step)
        values.append(ctx.model.statistic.item())
    aggregator.finish()
    return values


def _sgd_two_groups(params):
    """The first layer's weight and bias in one param group, the second layer's in another."""
    params = list(params)
    return torch.optim.SGD([{"params": params[:2]}, {"params": params[2:]}], lr=0.1)


def _slowmo_group_lrs(step: int) -> list[float]:
    """Rates of the two groups: unequal at the slow steps 3 and 11, and the second group's
    0 at slow step 7 (where its parameters did not train)."""
    return [_slowmo_lr(step), 0.0 if step == 7 else 0.05 * (1 + step % 5)]


def _group_lr_vector(step: int) -> torch.Tensor:
    """`_slowmo_group_lrs` per element of the flat model (first layer: 6 + 2, second: 2 + 1)."""
    first, second = _slowmo_group_lrs(step)
    return torch.tensor([first] * 8 + [second] * 3, dtype=torch.float64)


def _reference_slowmo(n: int, beta: float, alpha: float, base_period: int = SLOWMO["base_period"],
                      lrs=_slowmo_lr) -> dict[int, list[torch.Tensor]]:
    """SlowMo from its definition (Wang et al., 2020, Algorithm 1) over local SGD, n workers
    simulated in one process, all in flat vectors: x_i ← x_i − γ_s g_i; the base's average
    every 3 steps; every τ = 4 steps x_avg, u ← β u + (x_start − x_avg)/γ_s,
    x_start ← x_start − α γ_s u, and every worker starts again from x_start. `lrs(step)`: γ_s,
    a number or one per element; where an element's γ_s is 0, u stays and x_start = x_avg."""
    models = [_model() for _ in range(n)]
    start = _flat(models[0])
    velocity = torch.zeros_like(start)
    history = {rank: [] for rank in range(n)}
    for step in range(SLOWMO["steps"]):
        lr = lrs(step) * torch.ones_like(start)
        for rank, model in enumerate(models):
            gradient = flatten(_gradients(model, rank, step))
            _load(model, _flat(model) - lr * gradient)
        if (step + 1) % base_period == 0 or (step + 1) % SLOWMO["period"] == 0:
            average = sum(_flat(m) for m in models) / n
            for model in models:
                _load(model, average)
        if (step + 1) % SLOWMO["period"] == 0:
            trained = lr > 0
            velocity[trained] = beta * velocity[trained] + (start - average)[trained] / lr[trained]
            start = start - alpha * lr * velocity
            start[~trained] = average[~trained]
            for model in models:
                _load(model, start)
        for rank, model in enumerate(models):
            history[rank].append(_flat(model))
    return history


def _reference_periodic_averaging(n: int) -> dict[int, list[torch.Tensor]]:
    """Local SGD averaging after steps 3, 6, 9, ... and also after 4, 8, 12, ...: what slowmo
    with β = 0 and α = 1 must be."""
    models = [_model() for _ in range(n)]
    history = {rank: [] for rank in range(n)}
    for step in range(SLOWMO["steps"]):
        for rank, model in enumerate(models):
            gradient = flatten(_gradients(model, rank, step))
            _load(model, _flat(model) - _slowmo_lr(step) * gradient)
        if (step + 1) % 3 == 0 or (step + 1) % 4 == 0:
            average = sum(_flat(m) for m in models) / n
            for model in models:
                _load(model, average)
        for rank, model in enumerate(models):
            history[rank].append(_flat(model))
    return history


# -- resume -----------------------------------------------------------------------------------

def _scenario_resumed(rank, n, name, options, stop_after: int, steps: int):
    """Train `stop_after` steps, save model, inner optimizer and aggregator state through
    torch.save as a checkpoint does, rebuild everything, load, and train on to `steps`."""
    import io

    from dsgd_cli.spec.registry import load

    cls = load("aggregator", name)
    ctx = _context(rank, n, _adamw)
    aggregator = cls(cls.Options(**options))
    aggregator.setup(ctx)
    for step in range(stop_after):
        _step(aggregator, ctx, step)
    buffer = io.BytesIO()
    torch.save({"model": ctx.model.state_dict(), "optimizer": ctx.optimizer.state_dict(),
                "aggregator": aggregator.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    ctx = _context(rank, n, _adamw)
    ctx.model.load_state_dict(saved["model"])
    ctx.optimizer.load_state_dict(saved["optimizer"])
    aggregator = cls(cls.Options(**options))
    aggregator.setup(ctx)
    aggregator.load_state_dict(saved["aggregator"])
    for step in range(stop_after, steps):
        _step(aggregator, ctx, step)
    aggregator.finish()
    return _flat(ctx.model)


RESUMED = [  # (name, options, stop after, the uninterrupted run's scenario key)
    ("diloco", {"period": 4}, 6, "diloco"),
    ("streaming_diloco", {"period": 8, "fragments": 2, "delay": 1, "alpha": 0.25}, 7,
     ("streaming", (8, 2, 1, 0.25))),  # stops with fragment 1's exchange in flight
]


# -- one start of the workers runs every scenario ---------------------------------------------

def _all_scenarios(rank, n):
    torch.set_num_threads(1)
    from plugins.compressors.casts import Float16
    from plugins.compressors.sparsification import TopK

    streaming = {case: _scenario_streaming(rank, n, *case) for case in STREAMING_CASES}
    resumed = {name: _scenario_resumed(rank, n, name, options, stop,
                                       DILOCO["steps"] if name == "diloco" else STREAMING_STEPS)
               for name, options, stop, _ in RESUMED}
    return {"streaming": streaming, "resumed": resumed, "peak": _scenario_peak_bytes(rank, n),
            "slowmo_plain": _scenario_slowmo(rank, n, beta=0.0, alpha=1.0)["models"],
            "slowmo": _scenario_slowmo(rank, n, beta=0.6, alpha=0.8)["models"],
            "slowmo_sgp": _scenario_slowmo(rank, n, beta=0.6, alpha=0.8, base=SGP_BASE)["models"],
            "slowmo_groups": _scenario_slowmo(rank, n, beta=0.6, alpha=0.8, inner=_sgd_two_groups,
                                              lrs=_slowmo_group_lrs)["models"],
            "slowmo_buffers": _scenario_slowmo_buffers(rank, n),
            "slowmo_traffic": {name: _scenario_slowmo(rank, n, beta=0.6, alpha=0.8, base=base,
                                                      period=6)["traffic"]
                               for name, base in [("local_sgd", None), ("sgp", SGP_BASE)]},
            "diloco": _scenario_diloco(rank, n),
            "diloco_fp16": _scenario_diloco(rank, n, Float16()),
            "diloco_topk": _scenario_diloco(rank, n, TopK(TopK.Options(ratio=TOPK_RATIO)),
                                            error_feedback=True, dtype=torch.float32),
            "diloco_h1": _scenario_diloco_h1_is_averaging(rank, n)}


@pytest.fixture(scope="module")
def scenarios():
    return run_workers(_all_scenarios, WORKERS, preloaded=True)


def test_diloco_equals_its_definition(scenarios):
    """Parameters after every step (so at every round boundary and at the end, where the 2
    steps after the last round stay local) and the inner AdamW's state (both moments and its
    step count, which the outer step leaves alone), per worker."""
    reference = _reference_diloco(WORKERS)
    for rank, result in enumerate(scenarios):
        run = result["diloco"]
        assert len(run["models"]) == DILOCO["steps"]
        for step, (got, expected) in enumerate(zip(run["models"], reference["models"][rank])):
            assert torch.allclose(got, expected, rtol=0, atol=1e-12), (rank, step)
        assert len(run["inner_state"]) == 4
        for got, expected in zip(run["inner_state"], reference["inner_state"][rank]):
            assert torch.allclose(got[0], expected[0], rtol=0, atol=1e-12)  # exp_avg
            assert torch.allclose(got[1], expected[1], rtol=0, atol=1e-12)  # exp_avg_sq
            assert got[2] == expected[2] == DILOCO["steps"]
        assert run["rounds"] == [1.0, 2.0, 3.0]
    # The workers agree right after a round, and differ inside one.
    first, second = scenarios[0]["diloco"]["models"], scenarios[1]["diloco"]["models"]
    assert torch.equal(first[3], second[3]) and not torch.equal(first[4], second[4])


def test_diloco_sends_one_models_all_reduce_per_round_and_nothing_between(scenarios):
    numel = sum(p.numel() for p in _model().parameters())
    one_model = 2 * (WORKERS - 1) * numel * 8 // WORKERS  # float64 parameters
    for result in scenarios:
        traffic = result["diloco"]["traffic"]
        rounds = [s for s in range(DILOCO["steps"]) if (s + 1) % DILOCO["period"] == 0]
        assert [traffic[s] for s in rounds] == [one_model] * 3
        assert all(traffic[s] == 0 for s in range(DILOCO["steps"]) if s not in rounds)


def test_diloco_with_h1_and_plain_outer_sgd_is_model_averaging_every_step(scenarios):
    for result in scenarios:
        runs = result["diloco_h1"]
        for got, expected in zip(runs["diloco"], runs["averaging"]):
            assert torch.allclose(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("case", STREAMING_CASES, ids=[f"H{c[0]}-F{c[1]}-delay{c[2]}-alpha{c[3]}"
                                                         for c in STREAMING_CASES])
def test_streaming_diloco_equals_its_definition(scenarios, case):
    period, fragments, delay, alpha = case
    reference = _reference_streaming(WORKERS, *case)
    for rank, result in enumerate(scenarios):
        run = result["streaming"][case]
        assert len(run["models"]) == STREAMING_STEPS
        for step, (got, expected) in enumerate(zip(run["models"], reference[rank])):
            assert torch.allclose(got, expected, rtol=0, atol=1e-12), (rank, step)
        # fragment f is applied after steps (f + 1)·T + m·H
        segment = period // fragments
        applied = [((n - 1) // segment) % fragments for n in range(1, STREAMING_STEPS + 1)
                   if n % segment == 0]
        assert run["applied"] == applied


def test_streaming_diloco_sends_one_fragment_at_a_time(scenarios):
    """F = 4 over the 4 parameter tensors: each exchange is one tensor's all-reduce, after
    steps n ≡ T − delay (mod T); over a full H the bytes are one diloco round's."""
    sizes = [p.numel() for p in _model().parameters()]  # 6, 2, 2, 1
    run = scenarios[0]["streaming"][8, 4, 1, 0.0]
    sends = [n for n in range(1, STREAMING_STEPS + 1) if n % 2 == 1]
    expected = [0] * STREAMING_STEPS
    for n in sends:
        expected[n - 1] = 2 * (WORKERS - 1) * sizes[((n - 1) // 2) % 4] * 8 // WORKERS
    assert run["traffic"] == expected
    one_round = sum(2 * (WORKERS - 1) * size * 8 // WORKERS for size in sizes)
    assert sum(run["traffic"][:8]) == one_round
    assert max(run["traffic"]) == 2 * (WORKERS - 1) * max(sizes) * 8 // WORKERS


@pytest.mark.parametrize("name, options, stop, key", RESUMED, ids=[r[0] for r in RESUMED])
def test_a_resumed_run_goes_on_as_if_never_stopped(scenarios, name, options, stop, key):
    """The outer optimizers' momentum, θ_global and an exchange in flight are checkpointed."""
    for result in scenarios:
        uninterrupted = result[key[0]][key[1]] if isinstance(key, tuple) else result[key]
        assert torch.allclose(result["resumed"][name], uninterrupted["models"][-1], rtol=0, atol=1e-12)


def test_streaming_diloco_peak_bytes_per_step_are_1_over_f_of_diloco(scenarios):
    """Four equal tensors: the peak per step is diloco's round / F, the total over H equal."""
    for result in scenarios:
        sent = result["peak"]
        for fragments in (2, 4):
            assert max(sent[fragments]) * fragments == max(sent[None])
            assert sum(sent[fragments]) == sum(sent[None])


def test_fragments_follow_numpys_array_split():
    from plugins.aggregators.streaming_diloco import split_in_fragments

    numpy = pytest.importorskip("numpy")
    for length in range(0, 9):
        for count in range(1, 6):
            expected = [list(part) for part in numpy.array_split(list(range(length)), count)]
            assert split_in_fragments(list(range(length)), count) == expected


@pytest.mark.parametrize("options, expected", [
    ("period: 9, fragments: 2", "period: expected a multiple of fragments (2), got 9"),
    ("period: 8, fragments: 2, delay: 4", "delay: expected a value < period / fragments (4), got 4"),
    ("period: 8, alpha: 1.5", "experiments[0].aggregator.alpha: expected a value <= 1.0, got 1.5"),
    ("period: 8, alpha: -0.5", "experiments[0].aggregator.alpha: expected a value >= 0.0, got -0.5"),
])
def test_bad_streaming_diloco_exits_2_naming_the_key_path(tmp_path, options, expected):
    spec = write_spec(tmp_path, DILOCO_SPEC.format(aggregator=f"{{name: streaming_diloco, {options}}}"))
    result = dsgd_in_process("run", str(spec), "--dry-run")
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr and "experiments[0].aggregator" in result.stderr, result.stderr


def test_slowmo_with_beta_0_and_alpha_1_is_its_base_with_periodic_exact_averages(scenarios):
    reference = _reference_periodic_averaging(WORKERS)
    for rank, result in enumerate(scenarios):
        assert len(result["slowmo_plain"]) == SLOWMO["steps"]
        for got, expected in zip(result["slowmo_plain"], reference[rank]):
            assert torch.allclose(got, expected, rtol=0, atol=1e-12)


def test_slowmo_equals_its_definition(scenarios):
    reference = _reference_slowmo(WORKERS, beta=0.6, alpha=0.8)
    plain = _reference_periodic_averaging(WORKERS)
    for rank, result in enumerate(scenarios):
        for step, (got, expected) in enumerate(zip(result["slowmo"], reference[rank])):
            assert torch.allclose(got, expected, rtol=0, atol=1e-12), (rank, step)
    assert not torch.allclose(reference[0][-1], plain[0][-1], rtol=0, atol=1e-6)


def test_slowmo_over_sgp_equals_its_definition(scenarios):
    """With 2 workers SGP's push-sum round (each keeps half and pushes half to the other) is
    an exact average after every step, with weights 1: the reference is SlowMo over local
    SGD with period 1. The slow step must restart push-sum from its new model."""
    reference = _reference_slowmo(WORKERS, beta=0.6, alpha=0.8, base_period=1)
    for rank, result in enumerate(scenarios):
        for step, (got, expected) in enumerate(zip(result["slowmo_sgp"], reference[rank])):
            assert torch.allclose(got, expected, rtol=0, atol=1e-12), (rank, step)


def test_slowmo_takes_each_param_groups_own_rate(scenarios):
    """Two param groups at different rates (a plugin may build several; the schedule keeps
    their ratio): γ is each parameter's group's, and where a group's is 0 its parameters
    take x_avg and keep their u."""
    reference = _reference_slowmo(WORKERS, beta=0.6, alpha=0.8, lrs=_group_lr_vector)
    first_group_only = _reference_slowmo(WORKERS, beta=0.6, alpha=0.8,
                                         lrs=lambda step: _slowmo_group_lrs(step)[0])
    for rank, result in enumerate(scenarios):
        for step, (got, expected) in enumerate(zip(result["slowmo_groups"], reference[rank])):
            assert torch.allclose(got, expected, rtol=0, atol=1e-12), (rank, step)
    assert not torch.allclose(reference[0][3], first_group_only[0][3], rtol=0, atol=1e-6)


def test_slowmo_sends_the_model_once_on_a_slow_step(scenarios):
    """τ = 6 over local SGD averaging every 3 (fairscale's layout): one model's all-reduce
    after steps 3 and 6 alike, the slow step's exact average replacing the base's. Over SGP
    a slow step sends that all-reduce instead of its push-sum round (a message of the model
    and a 5-number header to one peer)."""
    numel = sum(p.numel() for p in _model().parameters())
    one_model = 2 * (WORKERS - 1) * numel * 8 // WORKERS  # float64 parameters
    gossip = (5 + numel) * 8
    for result in scenarios:
        traffic = result["slowmo_traffic"]
        assert traffic["local_sgd"] == [0, 0, one_model] * 4 + [0]
        assert traffic["sgp"] == [gossip] * 5 + [one_model] + [gossip] * 5 + [one_model] + [gossip]


def test_slowmo_averages_the_buffers_its_base_would_have_on_a_slow_step(scenarios):
    """The slow step replaces local SGD's average of step 4, buffers included, though slowmo's
    own `sync_buffers` is false: the buffers are averaged after steps 2 and 4 alike."""
    for rank, result in enumerate(scenarios):
        assert result["slowmo_buffers"] == [rank, 1.5, rank + 2, 3.5]


# -- launched runs ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def launched(tmp_path_factory, plugin_env):
    """One `dsgd run` of 2 workers on logreg, 8 steps of AdamW each: local SGD with period 4,
    and DiLoCo with H = 4 under three outer optimizers (one a third party's)."""
    from conftest import dsgd
    from dsgd_cli.results.store import Store

    tmp = tmp_path_factory.mktemp("launched")
    spec = write_spec(tmp, f"""
        defaults:
          task: {{name: logreg, features: 4, samples: 512}}
          workers: 2
          epochs: 1
          steps_per_epoch: 8
          batch_size: 32
          optimizer: {{name: adamw, lr: 0.05}}
          save_dir: {tmp / "models"}
        experiments:
          - name: local-4
            aggregator: {{name: local_sgd, period: 4}}
          - name: diloco-plain
            aggregator: {{name: diloco, period: 4, outer_optimizer: {{name: sgd, lr: 1.0}}}}
          - name: diloco-third-party
            aggregator: {{name: diloco, period: 4, outer_optimizer: {{name: scaled_sgd, lr: 2.0, scale: 0.5}}}}
          - name: diloco-paper
            aggregator: {{name: diloco, period: 4}}
          - name: streaming-one-fragment
            aggregator: {{name: streaming_diloco, period: 4, fragments: 1, outer_optimizer: {{name: sgd, lr: 1.0}}}}
          - name: streaming
            aggregator: {{name: streaming_diloco, period: 4, fragments: 2, delay: 1, alpha: 0.5}}
          - name: slowmo-plain
            aggregator: {{name: slowmo, period: 4, slow_momentum: 0.0, base: {{name: local_sgd, period: 4}}}}
          - name: slowmo
            aggregator: {{name: slowmo, period: 4, base: {{name: local_sgd, period: 2}}}}
    """)
    db = tmp / "results.db"
    result = dsgd("run", str(spec), "--db", str(db), env=plugin_env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    runs = {run.experiment: run for run in Store(str(db)).runs()}

    def weights(name: str, rank: int) -> torch.Tensor:
        return torch.load(tmp / "models" / name / f"rank{rank}.pt")["weight"]

    return runs, weights


# slow (with its siblings on `launched`, so the module's launch leaves the default suite): the
# definitions are checked in worker processes by test_diloco_equals_its_definition,
# test_streaming_diloco_equals_its_definition and test_slowmo_equals_its_definition, the outer
# optimizer's resolution by test_outer_optimizer_*, and test_level_bytes launches diloco,
# streaming_diloco and slowmo (all default)
@pytest.mark.slow
def test_launched_diloco_with_plain_outer_sgd_is_local_sgd(launched):
    """Outer SGD with lr 1 and no momentum makes θ_global − mean Δ = the mean model: local
    SGD with the same period, also through a third party's optimizer (lr 2 × scale 0.5), and
    for streaming DiLoCo with one fragment; slowmo with β = 0, α = 1 over local SGD with the
    same period is that local SGD."""
    _, weights = launched
    for rank in (0, 1):
        for name in ("diloco-plain", "diloco-third-party", "streaming-one-fragment", "slowmo-plain"):
            torch.testing.assert_close(weights(name, rank), weights("local-4", rank),
                                       rtol=1e-5, atol=1e-6)
    assert not torch.allclose(weights("diloco-paper", 0), weights("local-4", 0))


# slow: see test_launched_diloco_with_plain_outer_sgd_is_local_sgd
@pytest.mark.slow
def test_launched_diloco_records_its_outer_optimizer(launched):
    runs, _ = launched
    assert runs["diloco-paper"].config["aggregator"]["outer_optimizer"] == PAPER_OUTER
    assert runs["diloco-third-party"].config["aggregator"]["outer_optimizer"] == {
        "name": "scaled_sgd", "lr": 2.0, "scale": 0.5}
    assert runs["slowmo"].config["aggregator"]["base"] == {
        "name": "local_sgd", "period": 2, "error_feedback": False, "sync_buffers": True}
    assert runs["streaming"].config["aggregator"]["outer_optimizer"] == PAPER_OUTER
    assert all(run.status == "completed" for run in runs.values())


@pytest.mark.parametrize("name, exchange, dtype, atol", [
    ("diloco_fp16", _exchanged_in_fp16, torch.float64, 1e-12),
    ("diloco_topk", _exchanged_topk_with_error_feedback, torch.float32, 1e-6)])  # kernels: float32
def test_diloco_compresses_the_pseudo_gradient(scenarios, name, exchange, dtype, atol):
    """Δ through fp16 (Streaming DiLoCo's low-bit exchange) or top-k with error feedback
    (SparseLoCo's outer step): the models equal the definition with that exchange."""
    reference = _reference_diloco(WORKERS, exchange, dtype)
    exact = _reference_diloco(WORKERS, dtype=dtype)
    for rank, result in enumerate(scenarios):
        for got, expected in zip(result[name]["models"], reference["models"][rank]):
            assert torch.allclose(got, expected, rtol=0, atol=atol)
    assert not torch.allclose(reference["models"][0][-1], exact["models"][0][-1], rtol=0,
                              atol=100 * atol)


def test_diloco_sends_the_compressed_bytes(scenarios):
    numel = sum(p.numel() for p in _model().parameters())
    fp16_round = 2 * (WORKERS - 1) * numel * 2 // WORKERS
    for result in scenarios:
        traffic = result["diloco_fp16"]["traffic"]
        assert [traffic[s] for s in (3, 7, 11)] == [fp16_round] * 3
        assert sum(traffic) == 3 * fp16_round


def _replayed_diloco(config: dict) -> list[torch.Tensor]:
    """The launched `diloco` run replayed from the definition in one process: each worker's
    batches as the runtime draws them (its shard of the task's data, in the epoch's order),
    inner AdamW from the run's initial model, and every H steps Δ = (1/n) Σ (θ_global − θ_i),
    the outer Nesterov step b ← μ b + Δ, θ_global ← θ_global − lr (Δ + μ b), θ_i ← θ_global.
    Returns each worker's final weights."""
    from dsgd_cli.spec.experiments import build_plugin
    from dsgd_cli.spec.sharding import Shard

    n, seed, batch = config["workers"], config["seed"], config["batch_size"]
    period, outer = config["aggregator"]["period"], config["aggregator"]["outer_optimizer"]
    task = build_plugin("task", config["task"])
    data = task.load_data(seed)
    models = []
    for _ in range(n):
        torch.manual_seed(seed)
        models.append(task.build_model())
    inner = [torch.optim.AdamW(m.parameters(), lr=config["optimizer"]["lr"],
                               weight_decay=config["optimizer"]["weight_decay"]) for m in models]
    shards = [Shard(len(data.train_y), rank, n, seed).indices(0) for rank in range(n)]
    global_ = _flat(models[0])
    momentum = torch.zeros_like(global_)
    for step in range(config["steps_per_epoch"]):
        for model, optimizer, order in zip(models, inner, shards):
            index = order[step * batch: (step + 1) * batch]
            optimizer.zero_grad()
            task.loss(model(data.train_x[index]), data.train_y[index]).backward()
            optimizer.step()
        if (step + 1) % period == 0:
            delta = sum(global_ - _flat(m) for m in models) / n
            momentum = outer["momentum"] * momentum + delta
            global_ = global_ - outer["lr"] * (delta + outer["momentum"] * momentum)
            for model in models:
                _load(model, global_)
    return [model.weight.detach() for model in models]


# slow: see test_launched_diloco_with_plain_outer_sgd_is_local_sgd
@pytest.mark.slow
def test_launched_diloco_equals_its_definition_replayed(launched):
    """Inner AdamW, the paper's outer SGD with Nesterov momentum, H = 4, 2 workers, 8 steps."""
    runs, weights = launched
    replayed = _replayed_diloco(runs["diloco-paper"].config)
    for rank in (0, 1):
        torch.testing.assert_close(weights("diloco-paper", rank), replayed[rank],
                                   rtol=1e-5, atol=1e-6)
