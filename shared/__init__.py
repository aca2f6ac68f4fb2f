"""The contracts pdprof, pdplan and pdrun share: artifacts, specs, the tracer and the zoo."""

from shared.version import __version__

__all__ = ["__version__"]
