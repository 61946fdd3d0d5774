"""A real SGLang server for the demo and the end-to-end tests: launcher, a tiny model config
(dummy weights), import stubs for what SGLang imports but never calls on CPU, and the
scheduler-time probe plugin."""
