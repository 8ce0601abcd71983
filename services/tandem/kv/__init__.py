"""The paged KV cache: block bookkeeping (plain Python) and the block tensors of two tiers.

Importing this package imports no torch; `tandem.kv.cache` and attention do.
"""
