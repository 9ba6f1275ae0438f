"""Command-line tools for inspecting runs (`python -m tools.plot RUN_DIR`)."""
