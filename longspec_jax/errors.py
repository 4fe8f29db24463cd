"""The exceptions entry points handle specially.

`UserError`: a mistake a user can make and fix (bad path, prompt too long, ...). Entry points
catch it and print its message on one line, without a traceback.

`GenerationInterrupted`: Ctrl-C during generation. It is a KeyboardInterrupt (code that stops on
Ctrl-C still stops) carrying what was generated so far, so an entry point can still show it.
"""

from __future__ import annotations

from typing import Any


class UserError(ValueError):
    """A problem with the user's input; the message names the fix."""


class GenerationInterrupted(KeyboardInterrupt):
    """Generation stopped by KeyboardInterrupt. result: the `GenerationResult` of the tokens made
    so far (their stats cover the decoding done), or None when interrupted before the first token."""

    def __init__(self, result: Any = None):
        super().__init__("generation interrupted")
        self.result = result
