"""The params schema (`params`), assembled from the sections that credit methods and environments declare, and
its loader with clear errors. Imports `pipeline.credit`, `pipeline.rollout`, `pipeline.envs` and `pipeline.data`."""
