"""Routed-expert execution on the CPU socket."""

from tandem.experts.base import ExpertExecutor, ExpertsUnavailable, ExpertWeights
from tandem.experts.factory import make_expert_executor

__all__ = ["ExpertExecutor", "ExpertsUnavailable", "ExpertWeights", "make_expert_executor"]
