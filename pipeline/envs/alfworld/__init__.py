"""ALFWorld's household tasks (`env.name: alfworld`): `env` the environment over ALFWorld's TextWorld games, `games`
the generator of the games the project ships."""
