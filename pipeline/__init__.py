"""creditrl's library, in layers; each imports only the layers below it (docs/architecture.md):

    workflow  the stage registry, dvc.yaml, Snakemake/DVC records, run folders, tracking, the stage command line
    config    the params schema, assembled from the sections that methods and environments declare
    credit    the credit methods (one module each), grouping, the oracle, the naive row-by-row versions
    rollout   playing episodes, prompts, shards, demonstrations and the warm start
    model     policies: loading and saving, the tiny model, sampling engines, PPO, precision, processes, FSDP
    envs      the environments (one module each) and the action tag they parse
    data      the Parquet tables, the run's file layout, seeds, the params section base, figures
"""
