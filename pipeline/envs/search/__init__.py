"""Search agents over a passage corpus (`env.name: search`): `env` the environment, `index` the BM25 retriever,
`oracle` the exact distance over the agent's query set, `world` the generated corpus and questions the project ships."""
