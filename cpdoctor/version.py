"""cpdoctor's version, in the bottom layer so that every layer can read it."""

__version__ = "0.1.0"
