"""`loadback bench`: client (the wire), core (the orchestrator) and gpu (a CUDA KV pool)."""
