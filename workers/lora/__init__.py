"""LoRA adapters over the base model: reading PEFT's files, the worker's table of loaded adapters,
and the per-row delta a mixed batch adds to each targeted projection."""
