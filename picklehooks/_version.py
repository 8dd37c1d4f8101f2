"""The package version: one place, read by ``picklehooks.__version__``, MLflow's pip requirements and the docs."""

__version__ = "0.1.0"
