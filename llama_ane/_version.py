"""The package version, in one place: the package face, the manifest and the build read it."""

__version__ = "0.1.0"
