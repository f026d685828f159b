"""hetserve workers: one process per device.

The entry point (`python -m workers`) reads top-down as the mission:
bind -> capability -> load -> kernelize -> fp8 -> serve. Importing this package stays
cheap and torch-free, so the router can import the torch-free parts (`workers.topology`)
without touching a device.
"""
