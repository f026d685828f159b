"""The architecture registry: one small module per family, each declaring only what differs from
the Llama baseline (`llama.py`): its Hugging Face names (`architectures`, `model_type`), its one
map from Hugging Face tensor names to ours, and what its `config.json` switches on (norm
placement and style, q/k norms, activation, attention scale, soft-caps, sliding layers, rotary
per layer type, multipliers). `registry.py` finds a checkpoint's family; `base.py` holds the
`Family` value and what the families share. Adding a family is one module here, one line in
the registry and its test (tests/test_families.py).
"""
