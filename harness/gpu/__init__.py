"""GPU host helpers: rebuilding lmcache's CUDA ops and the device run script."""
