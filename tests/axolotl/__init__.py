"""Tests of the axolotl plugin on real axolotl (``make test-axolotl``, its own venv); skipped without axolotl."""
