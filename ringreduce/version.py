"""The version of ringreduce (one place: the package and autotune's cache keys read it)."""
__version__ = "0.1.0"
