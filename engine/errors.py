"""Errors a user can cause and fix. The CLI prints them as one line, without a traceback."""


class BucketserveError(Exception):
    """Base class of expected errors: bad input, bad configuration, missing files."""


class ModelLoadError(BucketserveError):
    """The model directory, its config or its weights cannot be used."""


class InvalidRequestError(BucketserveError, ValueError):
    """A request breaks a limit or carries a bad parameter."""


class UnwarmedShapeError(BucketserveError):
    """A forward was asked for at a shape that warmup never ran (strict shape mode)."""


class CapacityError(BucketserveError):
    """The KV cache has no room for what was asked."""


class CorruptFileError(ModelLoadError):
    """A model file (GGUF, safetensors) is truncated or is not what its name says."""
