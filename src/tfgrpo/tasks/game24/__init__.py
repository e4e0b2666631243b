"""The Game of 24: a task where a strategy (search in code, exact arithmetic) changes a small model's results."""

from tfgrpo.tasks.game24.datasets import SPLITS, load_game24
from tfgrpo.tasks.game24.program import Game24Solver
from tfgrpo.tasks.game24.verify import (check, evaluate_expression, extract_expression, game24_metric, game24_reward,
                                        puzzle_numbers)

__all__ = ["SPLITS", "Game24Solver", "check", "evaluate_expression", "extract_expression", "game24_metric",
           "game24_reward", "load_game24", "puzzle_numbers"]
