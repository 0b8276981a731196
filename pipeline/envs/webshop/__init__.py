"""WebShop's shopping agent (`env.name: webshop`): `env` the environment, `reward` WebShop's attribute, option and price
reward, `catalogue` the generated catalogue the project ships."""
