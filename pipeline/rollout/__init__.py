"""Playing episodes: prompts, the batched episode loop, shard slicing and merging, demonstrations and the warm
start. Imports `pipeline.envs`, `pipeline.model` and `pipeline.data`."""
