"""JSON that every strict parser reads. A float that is not finite (NaN, infinity) has no JSON
form: Python's `json` would write the bare words `NaN` and `Infinity`, which PostgreSQL, browsers
and most JSON libraries refuse. dsgd writes such a value as `null`, in the database and in every
json output."""

from __future__ import annotations

import json
import math
from typing import Any


def finite_only(value: Any) -> Any:
    """`value` with every float in it that is not finite replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_only(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_only(item) for item in value]
    return value


def dumps(value: Any, **options: Any) -> str:
    """`json.dumps` with non-finite floats written as null."""
    return json.dumps(finite_only(value), allow_nan=False, **options)
