"""The one error type the worker shows to users: a one-line message, never a traceback."""


class WorkerError(Exception):
    """Bad input the user can fix (model path, layout, prompt). `str(e)` is the whole message."""
