"""The loader's one error type, shared by every loader module."""


class BuildError(RuntimeError):
    """The kernels could not be built or loaded; the message names the cause, the path involved and a remedy."""
