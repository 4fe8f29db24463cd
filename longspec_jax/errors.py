"""The one exception type for mistakes a user can make and fix (bad path, prompt too long, ...).

Entry points catch it and print its message on one line, without a traceback.
"""


class UserError(ValueError):
    """A problem with the user's input; the message names the fix."""
