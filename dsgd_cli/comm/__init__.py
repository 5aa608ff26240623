"""How a run's processes talk to each other.

Workers talk to one another through `Comm` (communicator.py): every collective and
point-to-point call a plugin may make, with byte and time accounting and the spec's network
emulation; batching.py packs many tensors into one collective. Workers talk to the launcher
through the event channel (events.py): one JSON-lines file per rank, tailed by the launcher.
Nothing here knows about specs, plugins or the results database.
"""
