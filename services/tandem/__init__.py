"""Tandem: hybrid GPU + CPU-socket serving of Mixture-of-Experts language models.

Importing this package imports no torch: the operator imports `tandem.contract` from it.
"""

__version__ = "0.1.0"
