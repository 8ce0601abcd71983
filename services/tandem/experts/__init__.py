"""Routed-expert execution on the CPU socket."""

from tandem.experts.base import ExpertExecutor, ExpertsUnavailable, ExpertWeights

__all__ = ["ExpertExecutor", "ExpertsUnavailable", "ExpertWeights"]
