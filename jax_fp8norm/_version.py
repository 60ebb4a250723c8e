"""The version of the package, which its compiled modules must carry too."""

__version__ = "0.4.0"
