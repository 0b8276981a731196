"""Credit assignment: the method registry and one module per method (`credit.methods`), the shared terms
(`base`), learned step-reward models, grouping, the oracle and the naive row-by-row versions the tests compare
with. Imports `pipeline.envs`, `pipeline.model` and `pipeline.data`."""
