"""What tests and the chaos harness run against: a real daemon launcher, a fault-injecting
proxy, and an in-memory connector for faults a real daemon cannot produce.

Shipped in the wheel because `loadback chaos` and `loadback demo` start daemons and break them;
the product's request path never imports it.
"""
