"""The one exception type for a user's mistake.

Anything raised as `UserError` is printed by the CLI as a single line and exits 1;
every other exception is a bug in SuperNeurons and keeps its traceback.
"""


class UserError(Exception):
    """A problem in the user's files or flags: bad prototxt, unknown layer type, shape mismatch, missing file."""


class ShapeError(UserError):
    """Two layers disagree about a blob's shape."""


class PoolExhausted(UserError):
    """The device memory pool cannot satisfy an allocation within its budget."""
