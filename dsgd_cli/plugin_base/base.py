"""The root of every plugin kind: typed options and the name the registry found it under."""

from __future__ import annotations

from abc import ABC
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass
class NoOptions:
    """For plugins that take no options."""


class Plugin(ABC):
    """Common base: typed options, and the name the registry found the plugin under."""

    Options: ClassVar[type] = NoOptions
    plugin_name: ClassVar[str] = ""

    def __init__(self, options: Any = None):
        self.options = options if options is not None else self.Options()
