"""`python -m moaspec ...`: the same as the `moaspec` console script."""

from moaspec.cli import entry

entry()
