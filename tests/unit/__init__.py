"""Tests that run in the pytest process, no stage process launched (tests/README.md). A package so that a module
here may share its name with one in tests/distributed/."""
