"""hetserve's subcommands, one module each, imported only when chosen (server/cli.py): `serve`,
`plan` (and `plan --compile`, `plan_compile`), `compose`, `devices`, and the NVML or simulated
device `inventory` they start from."""
