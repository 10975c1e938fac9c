"""What the app and the CLI draw: attention overlays and figures (visualize.py), the workbench's
logic (workbench.py)."""
