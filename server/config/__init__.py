"""Every knob of a `hetserve serve` run, validated once into frozen values: the router's
settings (`settings`), the routing policy and its defaults (`routing`), the API key
(`api_key`), the reasoning parser (`reasoning`), the workers' decode step compilation
(`compile`)."""
