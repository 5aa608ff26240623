"""What tests ask of a checkpoint directory that no run needs."""

from __future__ import annotations

from pathlib import Path

from dsgd_cli.worker import checkpoint


def latest_complete(directory: str | Path | None, workers: int) -> int | None:
    """The latest step with every rank's file, or None."""
    complete = checkpoint.complete_steps(directory, workers)
    return complete[-1] if complete else None
