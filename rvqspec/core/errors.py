"""The one exception type users see: its message names the problem and the fix."""


class RvqspecError(ValueError):
    """Bad input (checkpoint, tree, sampler settings, ...). The CLI prints it as one line."""
