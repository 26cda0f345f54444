"""Starting `python -m experiments.train` on every host of a run: `local` (N processes on this
machine), `tpu_pod` (every worker of a TPU VM pod, multi-slice included), `slurm` (a GPU cluster
job). Each has --dry_run, which prints what every host would run. See docs/pods.md."""
