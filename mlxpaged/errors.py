"""The one exception type whose message is shown to users as is, on one line."""


class MlxPagedError(ValueError):
    """Bad input or an unusable model: the message names the problem and what to do."""
