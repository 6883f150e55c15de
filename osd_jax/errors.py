"""The project's kind of error for input a user can fix."""


class UserError(Exception):
  """A bad path, file or setting, not a bug: entry points print it on one line."""
