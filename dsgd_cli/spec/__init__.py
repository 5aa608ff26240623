"""From a YAML file to validated experiments.

specfile.py reads the spec (defaults merged, grids expanded, the worker count applied) without
importing torch, so `dsgd run` can start torchrun while the rest is checked; experiments.py
validates every key and resolves each experiment's plugins and their typed options;
registry.py finds plugins through entry points; nodes.py reads the `launch:` section for runs
across machines. What a key means beyond its type lives beside it: learning_rate.py
(`lr_scaling`, `lr_schedule`), compute_model.py (the emulated cluster's `compute`),
sharding.py (`data_split`: each rank's shard, steps per epoch), directories.py (directories
workers will write to). Every mistake found here is a `SpecError` naming the file and the key path.
"""
