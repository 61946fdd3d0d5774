"""Developer tools run from a checkout (`python -m tools.NAME`); not part of the wheel."""
