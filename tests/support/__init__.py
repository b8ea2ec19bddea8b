"""Builders that tests and benchmarks both import: lakes, real server processes, upstreams, a
local S3, racing writers, small models. No test module is imported by another; what two
modules share lives here (helpers) or in a folder's conftest.py (fixtures)."""
