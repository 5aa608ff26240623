"""Errors a user can cause, each carrying the process exit code the CLI returns."""


class DsgdError(Exception):
    """A problem the user can fix; the CLI prints the message on one line."""

    exit_code = 2


class SpecError(DsgdError):
    """Bad input in a spec file: names the file and the key path."""

    def __init__(self, message: str, *, file: str | None = None, path: str | None = None):
        self.file = file
        self.path = path
        self.detail = message
        where = ": ".join(part for part in (file, path) if part)
        super().__init__(f"{where}: {message}" if where else message)


class PluginError(DsgdError):
    """A plugin that is not installed, fails to import, or has the wrong base class."""


class StoreError(DsgdError):
    """The results database cannot be opened or read."""


class RunFailed(DsgdError):
    """At least one run ended in failure."""

    exit_code = 1


class Interrupted(DsgdError):
    """SIGINT (Ctrl-C), SIGTERM (timeout, SLURM, schedulers) or SIGHUP (a dropped SSH
    session) stopped dsgd."""

    def __init__(self, signal_name: str, exit_code: int):
        super().__init__(f"interrupted by {signal_name}")
        self.signal_name = signal_name
        self.exit_code = exit_code
