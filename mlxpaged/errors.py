"""The one exception type whose message is shown to users as is, on one line."""


class MlxPagedError(ValueError):
    """Bad input or an unusable model: the message names the problem and what to do."""


class AdapterRefused(MlxPagedError):
    """A LoRA adapter a request named, loaded on first use, cannot be served by this model (the
    server answers 400 with the reason)."""


class StepError(RuntimeError):
    """An engine step failed; the requests it was computing were aborted and their blocks freed.

    The engine stays usable: later steps run the other requests as if the failed ones had
    been aborted by the caller.
    """

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"engine step failed for {len(request_ids)} request(s): {type(cause).__name__}: {cause}")
        self.request_ids = request_ids
        self.cause = cause
