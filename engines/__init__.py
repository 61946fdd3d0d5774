"""Engine integrations, one subpackage per engine (`sglang`; the next beside it).

Each adapts its engine's cache API and KV pool to the core (`lmcache_loadback.orchestrator`)
and is loaded by the engine's own plugin mechanism; the core never imports an engine.
"""
