"""The experience library and how it gets into (and out of) DSPy programs."""

from tfgrpo.programs.inject import apply_library, load_program, save_program, strip_experiences, with_experiences
from tfgrpo.programs.library import ApplyReport, Experience, ExperienceLibrary

__all__ = ["ApplyReport", "Experience", "ExperienceLibrary", "apply_library", "load_program", "save_program",
           "strip_experiences", "with_experiences"]
