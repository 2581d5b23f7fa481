from . import stride_tricks  # noqa: F401
