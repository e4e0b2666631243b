"""The experience library, how it gets into (and out of) DSPy programs, and the learning calls' modules."""

from tfgrpo.programs.inject import apply_library, load_program, save_program, strip_experiences, with_experiences
from tfgrpo.programs.learning import AdvantageExtractor, Consolidator, LearningCallError, Summarizer
from tfgrpo.programs.library import ApplyReport, Experience, ExperienceLibrary

__all__ = ["AdvantageExtractor", "ApplyReport", "Consolidator", "Experience", "ExperienceLibrary", "LearningCallError",
           "Summarizer", "apply_library", "load_program", "save_program", "strip_experiences", "with_experiences"]
