"""Serving on the emulated two-level topology: run.py (the driver), rank.py, client.py, load.py, table.py."""
