"""Inside one worker process: `dsgd_cli.worker.process.main`, run in a process the launch's
fork server forks for each of torchrun's ranks (or, without one, `python -m
dsgd_cli.worker.process`).

process.py is the process: it waits for the launcher's plan and runs each experiment of the
launch. parts.py builds a worker's parts for one experiment (data, model, optimizer, `Comm`,
plugins, the compute model's padding); warmup.py takes one throwaway step before the clock
starts; training.py is the training loop, in the order the plugin API documents; schedule.py
says how long a worker trains, when it evaluates and how slow it is made to be; data.py loads
the data set and seeds augmentation; evaluation.py and model_evaluation.py evaluate on the
test set; interval_metrics.py sums a log interval's metrics; checkpoint.py saves and loads
every worker's state so a run resumes.
"""
