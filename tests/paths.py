"""Paths that tests in any folder share (tests mirror the package: tests/<room>/test_*.py)."""

import os

TESTS = os.path.dirname(os.path.abspath(__file__))
"""The tests/ folder (its data/ holds fixtures: chat templates, goldens)."""

REPO = os.path.dirname(TESTS)
"""The repository root."""
