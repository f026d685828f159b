"""Public HTTP routes, one module per concern: generate (TGI), openai, workers, health, metrics,
status (the page and its data), docs."""
