"""Claw lakehouse core: contracts, lake I/O, transforms, Dagster definitions, consume API."""

__version__ = "0.1.0"
