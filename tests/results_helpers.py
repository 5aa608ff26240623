"""What tests ask of a results database that no command needs."""

from __future__ import annotations

from sqlalchemy import text

from dsgd_cli.results.schema import METRICS


def count_metrics(results, run_id: int) -> int:
    """How many metric records run `run_id` holds, counted by the database: to check what a run
    recorded on SQLite and PostgreSQL alike, and to poll a run that is still writing.
    `results`: a `ResultsReader` or a `ResultsWriter` (`Store`)."""
    with results.connect() as connection:
        query = text(f"SELECT count(*) FROM {METRICS.name} WHERE run_id = :run_id")
        return connection.execute(query, {"run_id": run_id}).scalar_one()
