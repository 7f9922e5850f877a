"""Exceptions with messages that name the field, file or client at fault."""


class FedclusterError(Exception):
    """Base class of every error fedcluster raises on bad input."""


class ConfigError(FedclusterError, ValueError):
    """An experiment configuration is invalid; the message names the field."""


class DataError(FedclusterError, ValueError):
    """A dataset file is missing, truncated or corrupted; the message names the file."""
