"""Fixtures shared by the tests in this folder (none yet: the suite's helpers live in tests/helpers/)."""
