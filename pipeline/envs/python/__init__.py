"""Agents that compute with a Python interpreter (`env.name: python`): `env` the environment, `problems` the word
problems the project ships and the readers of GSM8K and MATH; programs run in `pipeline.envs.sandbox`."""
