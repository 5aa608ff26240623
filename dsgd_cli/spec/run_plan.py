"""What one launch of a run adds to the run's configuration: which run it is, and where its
checkpoints are and which one it resumes from. The configuration says what to train and is
the same for every launch of a run; the run plan changes from launch to launch (a resumed
run gets a resume step), so the two travel side by side in the launch plan, never mixed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping


@dataclass(frozen=True)
class RunPlan:
    run_id: int | None = None          # set when it continues a recorded run (resume, nodes)
    resume_step: int | None = None     # the checkpoint's step the workers start from
    checkpoint_dir: str | None = None  # None: the spec asked for no checkpoints

    @property
    def resuming(self) -> bool:
        return self.resume_step is not None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RunPlan:
        return cls(**raw)


def plan_entry(config: dict[str, Any], run: RunPlan) -> dict[str, Any]:
    """One experiment of the launch plan the workers read (JSON)."""
    return {"config": config, "run": run.to_dict()}


def read_plan_entry(entry: dict[str, Any]) -> tuple[dict[str, Any], RunPlan]:
    """The configuration and the run plan of one experiment of the launch plan."""
    return entry["config"], RunPlan.from_dict(entry["run"])


NO_RUN = RunPlan()  # a fresh run that keeps no checkpoints


def read_only(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """A view of `config` that cannot be changed, its sections neither: what `ctx.config`
    shows plugins (kept for plugins written before `ctx.experiment` and `ctx.run`)."""
    return MappingProxyType({key: read_only(value) if isinstance(value, Mapping) else value
                             for key, value in config.items()})
