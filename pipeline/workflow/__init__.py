"""The workflow: the stage registry (the Snakefile's rules and dvc.yaml come from it), dvc.yaml generation,
Snakemake/DVC record keeping, run folders and `run.base`, threads, MLflow tracking and the stage command line.
Imports every layer below it."""
