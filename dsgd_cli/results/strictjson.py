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


class NotJson(ValueError):
    """Stored text that cannot be read as JSON; the message says why in a few words."""


def loads(text: str | bytes) -> Any:
    """`json.loads` for text that another program may have written: each way it can fail is a
    NotJson. (Values an older dsgd wrote as NaN or Infinity still read, as floats.)"""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):  # (bytes that are not UTF-8)
        raise NotJson("not JSON") from None
    except RecursionError:  # arrays or objects nested thousands deep
        raise NotJson("JSON nested too deep") from None
    except ValueError:  # an integer of more digits than Python converts (4300)
        raise NotJson("a number too long to read") from None
