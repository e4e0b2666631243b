"""The math task: shipped problem sets (``load_math``) and the reward (``math_metric``)."""

from tfgrpo.tasks.math.datasets import BUILTIN, load_math, load_questions
from tfgrpo.tasks.math.metric import extract_answer, is_equivalent, math_metric

__all__ = ["BUILTIN", "load_math", "load_questions", "extract_answer", "is_equivalent", "math_metric"]
