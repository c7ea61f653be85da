"""Errors the CLI turns into one line on stderr and exit code 2."""


class UserError(Exception):
    """Bad input or environment the user can fix: printed as one line, exit code 2, no traceback."""


class SpecError(UserError):
    """A spec file has one or more problems; ``problems`` lists every one of them."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = list(problems)
        joined = "; ".join(problems)
        super().__init__(f"{source}: {len(problems)} problem(s): {joined}")
