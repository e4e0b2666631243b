"""The learning calls of Training-Free GRPO as DSPy signatures, and the typed operations they return."""

from tfgrpo.signatures.learning import (AdvantageExtractor, Consolidator, ConsolidateOperations, ExtractGroupAdvantage,
                                        GenerateExperiences,
                                        LearningCallError, Summarizer, SummarizeRollout)
from tfgrpo.signatures.operations import Operation, normalize_id

__all__ = ["AdvantageExtractor", "Consolidator", "ConsolidateOperations", "ExtractGroupAdvantage", "GenerateExperiences", "LearningCallError",
           "Operation", "Summarizer", "SummarizeRollout", "normalize_id"]
