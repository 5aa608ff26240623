"""dsgd: a command-line workbench for distributed data-parallel SGD on PyTorch.

A run goes through the folders in order: `spec` (the YAML file in, validated experiments
out), `launch` (the `dsgd run` process: torchrun, the workers' plan, their events into the
database), `worker` (inside each worker process: the training loop), with `comm` (how the
processes talk) below them all, and `results` (the database and what is read from it).
`commands` holds one module per `dsgd` command, put together by cli.py.

At the top stand the doors. For users: cli.py. For plugin authors: api.py, the one module a
plugin imports, with options.py (typed plugin options) and the plugin_base package (one
module per plugin kind, and a plugin's default checkpoint state) behind it, and the two helper modules docs/writing-plugins.md lists for plugins,
topology/ (communication graphs and mixing weights) and datacache.py (generated data sets cached on disk).
errors.py holds the errors a user can cause, with their exit codes.
"""

__version__ = "0.1.0"
