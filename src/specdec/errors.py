"""Errors a user can act on. Each message names the thing that is wrong and how to fix it."""


class SpecdecError(Exception):
    """Base class for specdec's user-facing errors."""


class ModelLoadError(SpecdecError):
    """A model or tokenizer could not be loaded."""


class VocabularyMismatchError(SpecdecError):
    """Target and prophet do not share a vocabulary."""


class ContextLengthError(SpecdecError, ValueError):
    """A prompt does not fit in the target's context."""
