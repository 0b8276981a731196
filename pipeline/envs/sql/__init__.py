"""NL2SQL agents on SQLite (`env.name: sql`): `env` the environment, `executor` the read-only query runner and its
guards, `ast_oracle` the gold query's AST components (the oracle and the expert), `world` the generated databases
the project ships."""
