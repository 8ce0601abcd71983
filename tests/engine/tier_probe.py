"""Counts what crosses between the KV tiers while an engine runs (for the tier tests)."""

from __future__ import annotations


def count_tier_traffic(engine):
    """Wraps the engine's runner: ({"out": blocks swapped out, "in": blocks swapped in}, [CPU-tier
    query tokens attended]) — both updated in place as the engine steps."""
    swaps, cpu_tokens = {"out": 0, "in": 0}, [0]
    real_swap, real_attention = engine.runner.swap, engine.runner.cpu_attention

    def swap(swap_out, swap_in):
        swaps["out"] += len(swap_out)
        swaps["in"] += len(swap_in)
        real_swap(swap_out, swap_in)

    def cpu_attention(layer, query, batch, scale, value_dim=0):
        if layer == 0:
            cpu_tokens[0] += query.shape[0]
        return real_attention(layer, query, batch, scale, value_dim)

    engine.runner.swap, engine.runner.cpu_attention = swap, cpu_attention
    return swaps, cpu_tokens
