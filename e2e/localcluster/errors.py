"""The one error the local control plane raises to its users."""


class ControlPlaneError(RuntimeError):
    """One line for the user: which component, what happened, which log to read."""
