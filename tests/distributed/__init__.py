"""Tests that launch stage processes (tests/README.md). A package so that a module here may share its name with one
in tests/unit/."""
