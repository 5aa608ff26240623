"""Push-sum state of one worker and the messages it exchanges (SGP and OSGP).

Each worker keeps a numerator x_i and a weight w_i (w_i = 1 at the start). In a round it keeps
a share p_ii of the pair (x_i, w_i), sends a share p_ji to each out-peer j, and adds every pair
it receives. The shares of one worker sum to one (a column of a column-stochastic matrix), so
Σ_i x_i, counting messages still in flight, never changes, and neither does Σ_i w_i = n. The
de-biased z_i = x_i / w_i converges to Σ x / n even on graphs that are not regular, where w_i
settles away from 1.

A message is one flat tensor: a header, then the share of the numerator. The weight travels
as two numbers of the message dtype (high and low part) so that float32 messages still carry
it to about float64 precision; round, sender and the sender's step count are small integers,
exact in float32 up to 2^24.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HEADER = 5  # weight (high part), weight (low part), round, sender rank, sender's step count


@dataclass(frozen=True)
class Received:
    round: int
    sender: int
    step: int


class PushSum:
    def __init__(self, numerator: torch.Tensor):
        self.numerator = numerator
        self.weight = 1.0  # a Python float (float64) whatever the model dtype

    def debiased(self) -> torch.Tensor:
        return self.numerator / self.weight

    def state_dict(self) -> dict:
        """For checkpoints (messages in flight are not in it: a resumed run goes on without
        their share of x and w)."""
        return {"numerator": self.numerator.clone(), "weight": self.weight}

    def load_state_dict(self, state: dict) -> None:
        self.numerator.copy_(state["numerator"])
        self.weight = state["weight"]

    def apply_update(self, delta_z: torch.Tensor) -> None:
        """The local optimizer, run on the de-biased model, changed it by `delta_z`; the step
        updates the numerator by that much: x += delta_z (plain SGD: x -= η g(z)), as in the
        paper's Algorithm 1. Then the average of the numerators moves exactly like minibatch
        SGD, x̄ -= (η/n) Σ g(z_i), however much weight is in flight. The authors' reference
        code does the same: it de-biases the parameters before the forward pass and turns them
        back into the numerator after the backward pass, so its optimizer steps x_i by the
        gradient taken at z_i, unscaled by w_i. (Where the optimizer's step depends on the
        parameters themselves, as weight decay does, the reference's sees x_i and this one
        z_i; the two agree while w_i = 1.)"""
        self.numerator.add_(delta_z)

    def emit(self, shares: dict[int, float], rank: int, round: int, step: int) -> dict[int, torch.Tensor]:
        """Split off the shares of (x, w) for the out-peers in `shares` (which also holds this
        worker's own share, `shares[rank]`); returns one CPU message per out-peer (peers with
        equal shares get the same tensor)."""
        by_share: dict[float, torch.Tensor] = {}
        messages = {}
        for peer, share in shares.items():
            if peer == rank:
                continue
            if share not in by_share:
                message = torch.empty(HEADER + self.numerator.numel(), dtype=self.numerator.dtype)
                message[HEADER:].copy_(self.numerator * share)
                weight = self.weight * share
                high = float(torch.tensor(weight, dtype=message.dtype))
                message[:HEADER] = torch.tensor([high, weight - high, round, rank, step],
                                                dtype=torch.float64)
                by_share[share] = message
            messages[peer] = by_share[share]
        keep = shares[rank]
        self.numerator.mul_(keep)
        self.weight *= keep
        return messages

    def absorb(self, message: torch.Tensor) -> Received:
        """Add a received share to this worker's (x, w)."""
        self.numerator.add_(message[HEADER:].to(self.numerator.device))
        header = message[:HEADER].tolist()
        self.weight += header[0] + header[1]
        return Received(round=int(header[2]), sender=int(header[3]), step=int(header[4]))


def message_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A receive buffer for one push-sum message (on the CPU, where messages travel)."""
    return torch.empty(HEADER + numel, dtype=dtype)


def end_message(dtype: torch.dtype, rank: int) -> torch.Tensor:
    """The last message a worker sends in OSGP's shutdown (round -1, no mass): a header only.
    gloo delivers a message shorter than the receive buffer posted for it, and the header
    alone says it is the end, so it costs HEADER numbers, not a model."""
    message = torch.zeros(HEADER, dtype=dtype)
    message[2], message[3] = -1, rank
    return message


def is_end(message: torch.Tensor) -> bool:
    return float(message[2]) < 0


def message_length(message: torch.Tensor) -> int:
    """How many numbers of its receive buffer a message filled (for `Comm.irecv`)."""
    return HEADER if is_end(message) else message.numel()
