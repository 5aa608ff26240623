"""One row of the current-figures table at the top of benchmarks/RESULTS.md.

Every benchmark ends its run by printing its headline figures as rows of that table, under a
line of their own, so that a new measurement is pasted rather than retyped:

    Row for RESULTS.md:
    | figure | value | machine | date | command |

`row()` formats one row: the machine (CPU model and core count, and the GPUs' names where
torch sees CUDA), today's date (ISO) and the command line as run (`python benchmarks/X.py
ARGS`) are filled in unless given. Pipes and line breaks in a cell are escaped, so a value
never splits the row.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = ("figure", "value", "machine", "date", "command")
HEADER = "Row for RESULTS.md:"


def cell(text: object) -> str:
    """A table cell: pipes escaped, line breaks and runs of spaces made one space."""
    return " ".join(str(text).split()).replace("|", "\\|")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def gpu_names() -> list[str]:
    """The CUDA devices' names, as torch sees them. torch is imported only where it already
    is or where `nvidia-smi` is installed: a CPU machine pays no torch import for a row."""
    if "torch" not in sys.modules and shutil.which("nvidia-smi") is None:
        return []
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # a broken CUDA set-up: the row still prints, without a GPU
        return []


def machine() -> str:
    cores = os.cpu_count() or 0
    text = f"{cpu_name()}, {cores} core{'s' if cores != 1 else ''}"
    gpus = gpu_names()
    if gpus:
        names = sorted(set(gpus))
        text += ", " + ", ".join(f"{gpus.count(n)}× {n}" if gpus.count(n) > 1 else n
                                 for n in names)
    return text


def command_line(argv: list[str] | None = None) -> str:
    """`python benchmarks/X.py ARGS` as run: the script's path relative to the repository
    where it lies inside it."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]) if argv else Path("?")
    try:
        script = script.resolve().relative_to(ROOT)
    except ValueError:
        pass
    return "python " + shlex.join([script.as_posix(), *argv[1:]])


def row(figure: str, value: object, *, command: str | None = None, machine_name: str | None = None,
        date: str | None = None) -> str:
    """`| figure | value | machine | date | command |`, the command in backticks."""
    cells = [cell(figure), cell(value), cell(machine_name or machine()),
             cell(date or datetime.date.today().isoformat()),
             "`" + cell(command or command_line()).replace("`", "'") + "`"]
    return "| " + " | ".join(cells) + " |"


def print_rows(*rows: tuple[str, object]) -> None:
    """Print HEADER, then one row per (figure, value), each on its own line."""
    name, command = machine(), command_line()
    print(f"\n{HEADER}")
    for figure, value in rows:
        print(row(figure, value, command=command, machine_name=name), flush=True)
