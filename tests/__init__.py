"""The tests, a package so that test files may share a basename and import tests.support (see README.md)."""
