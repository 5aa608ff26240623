"""Built-in local optimizers: thin, validated wrappers over torch.optim."""

from dataclasses import dataclass
from typing import Literal

import torch

from dsgd_cli.api import OptimizerPlugin, option


@dataclass
class SGDOptions:
    lr: float = option(0.05, min=0.0, help="learning rate")
    momentum: float = option(0.0, min=0.0, max=1.0, help="heavy-ball momentum")
    nesterov: bool = option(False, help="Nesterov momentum (needs momentum > 0)")
    weight_decay: float = option(0.0, min=0.0, help="L2 penalty")

    def __post_init__(self):
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov: true needs momentum > 0")


class SGD(OptimizerPlugin):
    Options = SGDOptions

    def build(self, params) -> torch.optim.Optimizer:
        o = self.options
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov,
                               weight_decay=o.weight_decay)


def _check_below_one(**values: float) -> None:
    """Each decay rate must be below 1: at 1 a moment stays at its initial 0 and the bias
    correction divides it by 1 − β^t = 0."""
    for name, value in values.items():
        if value >= 1:
            raise ValueError(f"{name}: expected a value < 1, got {value!r}")


@dataclass
class AdamOptions:
    lr: float = option(0.001, min=0.0, help="learning rate")
    beta1: float = option(0.9, min=0.0, max=1.0, help="first-moment decay, below 1")
    beta2: float = option(0.999, min=0.0, max=1.0, help="second-moment decay, below 1")
    eps: float = option(1e-8, min=0.0, help="denominator term")
    weight_decay: float = option(0.0, min=0.0, help="L2 penalty")

    def __post_init__(self):
        _check_below_one(beta1=self.beta1, beta2=self.beta2)


class Adam(OptimizerPlugin):
    Options = AdamOptions

    def build(self, params) -> torch.optim.Optimizer:
        o = self.options
        return torch.optim.Adam(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                weight_decay=o.weight_decay)


@dataclass
class AdamWOptions(AdamOptions):
    """Adam's options; weight decay is decoupled, and on by default as in torch."""

    weight_decay: float = option(0.01, min=0.0, help="decoupled weight decay: x ← x − lr·wd·x")


class AdamW(OptimizerPlugin):
    """Adam with decoupled weight decay (Loshchilov and Hutter, ICLR 2019), torch's AdamW."""

    Options = AdamWOptions

    def build(self, params) -> torch.optim.Optimizer:
        o = self.options
        return torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                 weight_decay=o.weight_decay)


def _trust_ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """numerator / denominator where both are positive, else 1: a layer whose weights or
    update are zero (a zero-initialised bias) takes the plain step, as LARS implementations do."""
    positive = (numerator > 0) & (denominator > 0)
    return torch.where(positive, numerator / torch.where(positive, denominator, 1.0),
                       torch.ones_like(numerator))


class LAMBOptimizer(torch.optim.Optimizer):
    """LAMB (You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76
    Minutes", ICLR 2020, Algorithm 2), per parameter tensor (a layer):

        m ← β1 m + (1 − β1) g,   v ← β2 v + (1 − β2) g²
        r = (m / (1 − β1^t)) / (√(v / (1 − β2^t)) + ε) + λ x
        x ← x − lr · (‖x‖ / ‖r‖) · r
    """

    def __init__(self, params, lr, betas, eps, weight_decay):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for x in group["params"]:
                if x.grad is None:
                    continue
                state = self.state[x]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(x)
                    state["exp_avg_sq"] = torch.zeros_like(x)
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(x.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(x.grad, x.grad, value=1 - beta2)
                update = (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + group["eps"])
                update.add_(x, alpha=group["weight_decay"])
                ratio = _trust_ratio(x.norm(), update.norm())
                x.sub_(update * (group["lr"] * ratio))
        return loss


class LARSOptimizer(torch.optim.Optimizer):
    """LARS (You, Gitman, Ginsburg, "Large Batch Training of Convolutional Networks", 2017,
    Algorithm 1), per parameter tensor (a layer), with the global rate γ = lr:

        λ = η ‖x‖ / (‖g‖ + β ‖x‖)          the local rate, η the trust coefficient
        v ← m v + γ λ (g + β x)            β the weight decay, m the momentum
        x ← x − v
    """

    def __init__(self, params, lr, momentum, weight_decay, trust_coefficient):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for x in group["params"]:
                if x.grad is None:
                    continue
                weight_norm = x.norm()
                local_lr = _trust_ratio(group["trust_coefficient"] * weight_norm,
                                        x.grad.norm() + group["weight_decay"] * weight_norm)
                update = (x.grad + group["weight_decay"] * x) * (group["lr"] * local_lr)
                state = self.state[x]
                if "velocity" not in state:
                    state["velocity"] = torch.zeros_like(x)
                velocity = state["velocity"].mul_(group["momentum"]).add_(update)
                x.sub_(velocity)
        return loss


@dataclass
class LAMBOptions(AdamOptions):
    """Adam's options, with the paper's eps (which must be positive) and decoupled decay."""

    eps: float = option(1e-6, min=0.0, help="denominator term > 0 (the paper's 1e-6)")
    weight_decay: float = option(0.01, min=0.0, help="decoupled weight decay λ, inside the trust ratio")

    def __post_init__(self):
        super().__post_init__()
        if self.eps <= 0:  # a zero gradient would give m̂ / √v̂ = 0 / 0
            raise ValueError(f"eps: expected a value > 0, got {self.eps!r}")


class LAMB(OptimizerPlugin):
    Options = LAMBOptions

    def build(self, params) -> torch.optim.Optimizer:
        o = self.options
        return LAMBOptimizer(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                             weight_decay=o.weight_decay)


@dataclass
class LARSOptions:
    lr: float = option(0.1, min=0.0, help="global learning rate γ")
    momentum: float = option(0.9, min=0.0, max=1.0, help="momentum m")
    weight_decay: float = option(0.0005, min=0.0, help="weight decay β (the paper's 0.0005)")
    trust_coefficient: float = option(0.001, min=0.0, help="η > 0, the paper's 0.001")

    def __post_init__(self):
        if self.trust_coefficient <= 0:  # λ = 0: nothing would train
            raise ValueError("trust_coefficient: expected a value > 0, "
                             f"got {self.trust_coefficient!r}")


class LARS(OptimizerPlugin):
    Options = LARSOptions

    def build(self, params) -> torch.optim.Optimizer:
        o = self.options
        return LARSOptimizer(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay,
                             trust_coefficient=o.trust_coefficient)


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon (Jordan et al., 2024) for the model's hidden 2-D weights and AdamW for every other
    parameter, in one optimizer, as Muon's authors advise. It is `torch.optim.Muon` and
    `torch.optim.AdamW` side by side: one param group each, stepped by those classes, so each
    part is exactly torch's. The runtime and the schedule see two param groups with their own
    learning rates (a schedule scales both, keeping their ratio), and one state dict."""

    def __init__(self, matrices: list[torch.Tensor], others: list[torch.Tensor],
                 muon: dict, adamw: dict):
        parts = {}
        if matrices:  # torch refuses an optimizer over nothing
            parts["muon"] = torch.optim.Muon(matrices, **muon)
        if others:
            parts["adamw"] = torch.optim.AdamW(others, **adamw)
        groups = []
        for kind, part in parts.items():
            for group in part.param_groups:
                group["kind"] = kind  # kept through state_dict / load_state_dict
                groups.append(group)
        super().__init__(groups, {})
        self.parts = parts

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for kind, part in self.parts.items():
            # load_state_dict replaces the groups and the state: hand the current ones over
            part.param_groups = [g for g in self.param_groups if g["kind"] == kind]
            part.state = self.state
            part.step()
        return loss


@dataclass
class MuonOptions:
    lr: float = option(0.001, min=0.0, help="Muon's learning rate for the hidden 2-D weights "
                                            "(torch.optim.Muon's default)")
    momentum: float = option(0.95, min=0.0, max=1.0, help="Muon's momentum μ")
    nesterov: bool = option(True, help="Nesterov momentum: orthogonalise g + μB instead of B")
    weight_decay: float = option(0.1, min=0.0, help="Muon's decoupled weight decay (torch's default)")
    ns_steps: int = option(5, min=1, max=99, help="Newton–Schulz iterations")
    adjust_lr: Literal["original", "match_rms_adamw"] = option(
        "original", help="Muon's rate per matrix of shape A×B: original, lr·√max(1, A/B) "
                         "(Keller Jordan's); match_rms_adamw, 0.2·lr·√max(A, B) (Moonshot's)")
    adamw_lr: float = option(0.001, min=0.0, help="AdamW's learning rate for the other parameters")
    adamw_beta1: float = option(0.9, min=0.0, max=1.0, help="AdamW's first-moment decay, below 1")
    adamw_beta2: float = option(0.999, min=0.0, max=1.0, help="AdamW's second-moment decay, below 1")
    adamw_eps: float = option(1e-8, min=0.0, help="AdamW's denominator term")
    adamw_weight_decay: float = option(0.01, min=0.0, help="AdamW's decoupled weight decay")
    adamw_first: int = option(1, min=0, help="the first N 2-D parameters in model order take "
                                             "AdamW, not Muon: the input embedding or input layer "
                                             "(text_lm: 2, its token and position tables)")
    adamw_last: int = option(1, min=0, help="the last N 2-D parameters in model order take "
                                            "AdamW, not Muon: the output layer (text_lm: 0, its "
                                            "output layer is its embedding)")

    def __post_init__(self):
        _check_below_one(adamw_beta1=self.adamw_beta1, adamw_beta2=self.adamw_beta2)


class Muon(OptimizerPlugin):
    """Muon for 2-D weights (torch.optim.Muon), AdamW for the rest (torch.optim.AdamW).

    Muon's authors keep biases, norms, embeddings and the output layer on AdamW. An optimizer
    plugin receives the parameters only, not the modules they belong to, so "hidden" is
    decided by shape and position: every parameter that is not 2-D (biases, norms,
    convolution kernels) takes AdamW, and so do the first `adamw_first` (default 1: the input
    embedding or input layer) and the last `adamw_last` (default 1: the output layer) 2-D
    ones in model order. A model with several embedding tables or a tied output layer sets
    them (text_lm: `adamw_first: 2, adamw_last: 0`)."""

    Options = MuonOptions

    def build(self, params) -> torch.optim.Optimizer:
        o = self.options
        params = list(params)
        matrices = [p for p in params if p.ndim == 2]
        last = matrices[len(matrices) - o.adamw_last:] if o.adamw_last else []
        to_adamw = {id(p) for p in matrices[:o.adamw_first] + last}
        hidden = [p for p in matrices if id(p) not in to_adamw]
        others = [p for p in params if p.ndim != 2 or id(p) in to_adamw]
        return MuonWithAdamW(
            hidden, others,
            muon=dict(lr=o.lr, momentum=o.momentum, nesterov=o.nesterov,
                      weight_decay=o.weight_decay, ns_steps=o.ns_steps, adjust_lr_fn=o.adjust_lr),
            adamw=dict(lr=o.adamw_lr, betas=(o.adamw_beta1, o.adamw_beta2), eps=o.adamw_eps,
                       weight_decay=o.adamw_weight_decay))
