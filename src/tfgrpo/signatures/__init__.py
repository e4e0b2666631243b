"""The learning calls of Training-Free GRPO as DSPy signatures, and the typed operations they return."""

from tfgrpo.signatures.learning import ConsolidateOperations, ExtractGroupAdvantage, GenerateExperiences, SummarizeRollout
from tfgrpo.signatures.operations import Operation, normalize_id

__all__ = ["ConsolidateOperations", "ExtractGroupAdvantage", "GenerateExperiences", "Operation", "SummarizeRollout",
           "normalize_id"]
