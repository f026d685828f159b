"""Pipeline stages: one model's layers over several workers, each on its own device.

The first stage is a full worker (HTTP socket, scheduler, sampling) whose runner sends each
step's hidden states on to the next stage (`runner.py`) and whose engine keeps several batches in
flight (`engine.py`); the other stages run their layers on what they receive (`follower.py`);
`first.py` builds the first stage's engine and holds the others; `launch.py` starts them from the
router's plan and watches them; `metrics.py` reports each stage's step figures; `transport.py` is
the one place that speaks `torch.distributed`. Each stage binds its own device, loads only its
layers and picks its own kernels and fp8 convention; activations cross in the compute dtype,
never fp8."""
