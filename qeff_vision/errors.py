"""Errors the CLI turns into one line on stderr and exit code 2."""

import reprlib

# A user-written value quoted in a message is cut to a bounded text: a spec can hold a list
# of millions of items (or an alias bomb), and one error line must stay one short line.
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxdict, _SHOWN.maxtuple = 2, 4, 4, 4
_SHOWN.maxstring = _SHOWN.maxother = _SHOWN.maxlong = 60


def shown(value: object) -> str:
    """``repr(value)`` cut to a short, bounded text, for messages that quote a user's value."""
    return _SHOWN.repr(value)


class UserError(Exception):
    """Bad input or environment the user can fix: printed as one line, exit code 2, no traceback."""


class SpecError(UserError):
    """A spec file has one or more problems; ``problems`` lists every one of them."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = list(problems)
        joined = "; ".join(problems)
        super().__init__(f"{source}: {len(problems)} problem(s): {joined}")
