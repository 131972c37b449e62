"""User-facing errors.

Every problem a user can cause (a bad path, a corrupt file, an out-of-range flag) is raised as a
:class:`GemmaspecError` whose message says what is wrong and what to do. The CLI prints that message
on one line and exits non-zero; library users can catch the class.
"""


class GemmaspecError(Exception):
    """An error caused by input, with a message meant for the user (no traceback needed)."""


class ModelFileError(GemmaspecError):
    """A model file is missing, unreadable, corrupt, truncated, or of an unsupported kind."""


class UnsupportedArchitectureError(ModelFileError):
    """The file describes an architecture gemmaspec does not implement."""


class InputError(GemmaspecError):
    """A prompt or a generation parameter is out of range."""
