"""vLLM backend: a KV connector (vLLM's KV connector v1 API) placeholder until the connector lands."""
