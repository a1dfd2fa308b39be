"""Helpers, constants and case tables the test files share, by topic: no test file imports another."""
