"""The emulated cluster: what makes a run on one machine behave as the spec's cluster would.

A run keeps two timelines: the real one (what `time.perf_counter` measures on this machine)
and the modeled one (the cluster's), `time_scale` times faster (the spec's
`compute.time_scale`, 1 without a compute model). Every time dsgd records is modeled.

* clock.py: `Clock`, the only place real and modeled seconds are converted. Each worker has
  one, `ctx.clock`, shared by the runtime (budgets in seconds, the event channel's `seconds`,
  the steps' times) and the plugins (their waits and timeouts).
* compute.py: the compute model: each step's forward and backward padded to its modeled
  duration (`PaddedCompute`), with its per-step random variation.
* network.py: the network model (`NetworkModel`: latency and bandwidth of a link) and the
  stretch of every emulated link, plain or on a cluster of nodes and regions, into real time.
* stragglers.py: the emulated load imbalance (`Straggling`): fixed slow ranks and random slow
  steps drawn from the run's seed.

What the spec says about each (parsing, validation, advice to the user) lives in `spec/`.
"""
