"""The worker's routes on its Unix socket, one module per concern: generation (TGI shapes) and
the router's probes (`/health`, `/capability`, `/metrics`)."""
