"""Shared helper for the test-only stub packages in this folder (torchvision, vllm._custom_ops).

SGLang imports these modules at module level on its CPU path but never calls into them there;
PyPI's torchvision is a CUDA build and vllm has no CPU wheel, so tests put these stubs on
PYTHONPATH. Anything called raises, so a code path that really needs them fails loudly.
"""


class StubCalled(RuntimeError):
    pass


def raising(qualname):
    def _stub(*args, **kwargs):
        raise StubCalled(
            f"{qualname} is a test-only stub (harness/sglang/stubs); this code path needs the real "
            f"package, which the CPU test environment does not install"
        )

    _stub.__name__ = qualname.rsplit(".", 1)[-1]
    _stub.__qualname__ = qualname
    return _stub


def module_getattr(modname):
    """A module-level __getattr__: any public name resolves to a function that raises when called."""

    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return raising(f"{modname}.{name}")

    return __getattr__
