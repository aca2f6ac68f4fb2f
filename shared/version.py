"""The toolchain's version, the one place it is written."""

__version__ = "0.1.0"
FORMAT_GRAPH = "pdprof.graph/1"
FORMAT_TABLE = "pdprof.table/1"
FORMAT_PLAN = "pdplan.plan/1"
FORMAT_METRICS = "pdrun.metrics/1"
