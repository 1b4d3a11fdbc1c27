"""The data errors training raises: each message says what is wrong and how to get the files."""
from __future__ import annotations


class DataNotFoundError(FileNotFoundError):
    """The dataset's files are missing and could not be downloaded; the message says how to get them."""


class DataChecksumError(DataNotFoundError):
    """A dataset file is there but is not the known file (truncated, damaged, or other data)."""
