"""Errors that users see. Each message says what went wrong and what to do about it.

The CLI catches :class:`AdaptError` and prints its message without a traceback.
"""


class AdaptError(Exception):
    """Base class for errors caused by input or environment, not by a bug in adapt."""


class ConfigError(AdaptError):
    """A run configuration, preset or ``--set`` override is invalid."""


class ModelLoadError(AdaptError):
    """The model could not be loaded, or is not a causal decoder."""


class NotBidirectionalError(AdaptError):
    """The bidirectionality probe found that a late token does not change early hidden states."""


class DataError(AdaptError):
    """A corpus, task or input file is missing, empty, malformed or undecodable."""


class TrainingError(AdaptError):
    """Training cannot go on (for example a NaN or infinite loss)."""


class OutputExistsError(AdaptError):
    """The output folder already holds another run."""
