"""Errors exl raises for bad input. Each message says what is wrong, where, and what to do."""


class ExlError(Exception):
    """Base class: a problem with the user's input or files (not a bug in exl)."""


class ModelLoadError(ExlError):
    """A model folder or file cannot be loaded."""


class UnsupportedModelError(ModelLoadError):
    """The architecture or file type is not supported."""
