"""Running experiments: the parent process of `dsgd run`.

launcher.py groups consecutive experiments into launches, starts one torchrun per launch
(torchrun.py; the processes torchrun starts are relays, relay.py, to the launch's fork server,
forkserver.py, which forks the workers), sends the workers their plan, tails their event files
into the results store (run_events.py decodes them) and ends a launch when a worker fails or
the user interrupts, recording how each run ended (outcome.py); resume.py
reopens an interrupted or failed run from its last checkpoint; unrecorded.py keeps what a
run's workers recorded when its database could not be written, for `dsgd runs recover`. The
code that runs inside a worker is `dsgd_cli.worker`.
"""
