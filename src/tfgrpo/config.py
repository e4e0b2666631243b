"""One TOML file selects everything: the LMs, the task and its data, the optimizer's knobs, the evaluation.

Validated by pydantic; an error names the file and the field. API keys are never in the file: it names the
environment variable that holds the key (`api_key_env`).
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal, get_args, get_type_hints

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, create_model, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from tfgrpo.local_model import DEFAULT_SPECULATIVE, SpeculativeMode
from tfgrpo.local_weights import DEFAULT_MODEL, MODELS
from tfgrpo.optimizers.knobs import KNOBS, Knobs, check_knob

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class _Strict(BaseModel):
    # a misspelled key is an error, not a silent default; a value of the wrong type ("12" for 12) too
    model_config = ConfigDict(extra="forbid", strict=True)


class LMConfig(_Strict):
    backend: Literal["local", "litellm"] = "local"  # local: the embedded llama.cpp model; litellm: any provider
    model: str = DEFAULT_MODEL  # local model name, or a LiteLLM model string ("deepseek/deepseek-chat")
    api_base: str | None = None  # OpenAI-compatible endpoint (vLLM, Ollama, a remote llama.cpp server)
    api_key_env: str | None = None  # NAME of the environment variable holding the key (never the key)
    temperature: float = Field(0.3, ge=0, le=2)  # used for evaluation; learning rollouts use optimizer.temperature
    max_tokens: int = Field(512, ge=16)  # cap on each reply; the 1.5B model rambles past 512
    num_retries: int = Field(3, ge=0)  # provider retries with backoff on errors and rate limits
    # the provider's requests-a-minute limit: calls wait their turn instead of drawing 429s (tfgrpo.optimizers.RequestPacer)
    max_requests_per_minute: int | None = Field(None, ge=1)
    timeout_s: float = Field(180, gt=0)  # one call's time limit: a runaway reply cannot stall a step
    cache: bool = True  # DSPy's on-disk cache of replies: a re-run of the same prompts costs nothing
    n_ctx: int = Field(8192, ge=512)  # local backend only: context window of the server
    n_threads: int | None = None  # local backend only: CPU threads (default: all cores)
    # local only: how the server drafts tokens for the model to check (see tfgrpo.local_model.SPECULATIVE); the
    # replies are samples of the same model either way, only faster
    speculative: SpeculativeMode = DEFAULT_SPECULATIVE
    parallel: int | None = Field(None, ge=1)  # local only: requests decoded together (llama-server; default: cores/2, at most 4)
    # more settings for dspy.LM, as its keyword arguments: reasoning_effort = "low", extra_body = {...} ([policy.extra])
    extra: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _known_local_model(self):
        """A local backend's model is one of the embedded models (a dry run refuses what a run would)."""
        if self.backend == "local" and self.model not in MODELS:
            raise ValueError(f"model = {self.model!r} is no embedded model (backend = \"local\"): choose one of "
                             f"{sorted(MODELS)}, or set backend = \"litellm\" (with api_base for a server of your own)")
        return self

    @field_validator("extra")
    @classmethod
    def _no_secret_in_extra(cls, value):
        taken = {"model", "temperature", "max_tokens", "num_retries", "timeout", "cache", "api_base", "api_key"}
        if clash := sorted(set(value) & taken):
            raise ValueError(f"{clash} have keys of their own in the section (api_key: api_key_env, the NAME of the "
                             "variable holding it); extra is for the other settings of dspy.LM")
        return value

    @property
    def constrained_mode(self) -> str | None:
        """How to ask this backend for JSON-schema constrained decoding, where the project knows it: the embedded
        llama.cpp server takes the schema in `{"type": "json_object", "schema": ...}` ("json_object"). None for other
        backends (the optimizer's `constrained_decoding="auto"` then asks LiteLLM)."""
        return "json_object" if self.backend == "local" else None

    @field_validator("api_key_env")
    @classmethod
    def _key_present(cls, value, info: ValidationInfo):
        """A variable's name, set in the environment unless the config is loaded for a dry run (which calls
        nothing: `Config.load(path, need_keys=False)`)."""
        if value and looks_like_a_key(value):  # never echoed: it may be the secret itself
            raise ValueError("api_key_env looks like a key, not the name of an environment variable (its value is not "
                             "shown): put the key in an environment variable and give its name, such as "
                             "api_key_env = \"OPENAI_API_KEY\"")
        if value and value not in os.environ and (info.context or {}).get("need_keys", True):
            raise PydanticCustomError("missing_key", "api_key_env names '{name}', which is not set in the environment: "
                                      "export {name}=... first (a dry run needs none)", {"name": value})
        return value


def looks_like_a_key(value: str) -> bool:
    """Whether `value`, given where a variable's name belongs, looks like a secret pasted in its place: not a name
    a shell would take (sk-..., a key with dots or slashes), or a long mix of lower-case letters and digits."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        return True
    return len(value) >= 20 and any(c.islower() for c in value) and sum(c.isdigit() for c in value) >= 3


def _task_name(name: str | None, program: str | None) -> str:
    """The task a [task] section means: its name, else custom when program names a "module:name", else math."""
    return name or ("custom" if ":" in (program or "") else "math")


class TaskConfig(_Strict):
    # builtin tasks: math, game24 (a program the model writes), web (a search agent, see [web]); custom: your own
    # program, metric and data. Left out: custom when program names a "module:name", else math.
    name: Literal["math", "game24", "web", "custom"] | None = None
    program: str = "cot"  # math: cot | react (ReAct with a Python tool); custom: "module:name" or "file.py:name"
    metric: str | None = None  # custom only: "module:name" of metric(example, pred, trace=None) (or (example, pred))
    train_metric: str | None = None  # custom only: a separate reward while learning; default: metric
    input_keys: list[str] | None = Field(None, min_length=1)  # custom only: the fields of a data row the program takes
    train_reward: Literal["partial", "strict"] = "partial"  # game24 only: partial credit while learning (see game24_reward)
    trainset: str = "gsm8k_train"  # builtin name, JSONL path or hub id (see tfgrpo.tasks.math.datasets, tasks.game24)
    train_limit: int | None = None  # None: the whole set
    train_offset: int = 0
    valset: str | None = None  # optional: keeps the best epoch's library
    val_limit: int | None = None
    evalset: str = "gsm8k_test"
    eval_limit: int | None = None
    eval_offset: int = 0
    attribution_set: str | None = None  # with optimizer.attribution: held-out rows each item is measured on (else valset)
    attribution_limit: int | None = None
    attribution_offset: int = 0
    max_iters: int = Field(4, ge=1)  # react and web: tool turns per problem

    @field_validator("program")
    @classmethod
    def _program_fits_the_task(cls, value, info):
        name = _task_name(info.data.get("name"), value)
        if name == "custom" and ":" not in value:
            raise ValueError(f"your own program is named as 'module:name' or 'path/to/file.py:name', not {value!r}")
        if name != "custom" and ":" in value:
            raise ValueError(f"{value!r} names your own program: set task.name = \"custom\" (or leave name out)")
        if name == "math" and value not in ("cot", "react"):
            raise ValueError(f"the math task's program is 'cot' or 'react' ('module:name' for your own), not {value!r}")
        return value

    @field_validator("metric", "train_metric", "input_keys")
    @classmethod
    def _only_for_your_own_program(cls, value, info):
        if value is not None and _task_name(info.data.get("name"), info.data.get("program")) != "custom":
            raise ValueError("only for your own program (task.name = \"custom\", program = \"module:name\")")
        if isinstance(value, str) and ":" not in value:
            raise ValueError(f"a metric is named as 'module:name' or 'path/to/file.py:name', not {value!r}")
        return value

    @model_validator(mode="after")
    def _own_program_is_complete(self):
        self.name = _task_name(self.name, self.program)
        if self.name == "custom":
            missing = [f for f in ("metric", "input_keys", "trainset", "evalset")
                       if getattr(self, f) is None or (f in ("trainset", "evalset") and f not in self.model_fields_set)]
            if missing:
                raise ValueError(f"your own program needs {', '.join(missing)} too (see tfgrpo config --reference)")
        return self


class WebConfig(_Strict):
    """The web task's tools and reward (used when task.name = "web")."""

    agent: Literal["step", "react"] = "step"  # step: one action + one string argument per turn (small models); react: dspy.ReAct
    search: Literal["local", "serper", "tavily", "brave"] = "local"  # local: the offline site over `corpus`
    api_key_env: str | None = None  # online backends: NAME of the key's variable (default SERPER_/TAVILY_/BRAVE_API_KEY)
    corpus: str = "hotpotqa"  # local only: builtin corpus name or a JSONL file of {title, text} rows
    site_url: str | None = None  # local only: a site already running (python -m tfgrpo.tasks.web.site); None: start one
    top_k: int = Field(5, ge=1, le=20)  # results per search
    snippet_chars: int = Field(300, ge=40)  # what the agent sees of each result
    page_chars: int = Field(3000, ge=200)  # what the agent sees of an opened page
    page_passages: bool = False  # with a goal, the policy LM keeps only a page's passages that serve it (the paper's page tool)
    reward: Literal["judge", "f1", "em"] = "judge"  # learning reward; evaluation reports all three

    @field_validator("api_key_env")
    @classmethod
    def _a_name_not_a_key(cls, value):
        if value and looks_like_a_key(value):  # never echoed: it may be the secret itself
            raise ValueError("api_key_env looks like a key, not the name of an environment variable (its value is not "
                             "shown): put the key in an environment variable and give its name")
        return value


# TrainingFreeGRPO's knobs a file cannot hold, and where the CLI gets them instead
SET_ELSEWHERE = {"reflection_lm": "the [reflection] section", "log_dir": "run_dir/checkpoint",
                 "progress": "the CLI's own progress bars", "use_mlflow": "the [tracking] section"}


class _OptimizerSection(_Strict):
    """The [optimizer] keys of the CLI alone; `OptimizerConfig` adds the optimizer's knobs."""

    # strict: no coercion ("yes" is no bool); defaults checked too; learning_path's type names a class (LearningPath)
    model_config = ConfigDict(strict=True, validate_default=True, arbitrary_types_allowed=True)

    method: Literal["tfgrpo", "direct"] = "tfgrpo"  # direct: the "directly generated experiences" baseline
    num_direct_experiences: int = Field(27, ge=1)  # direct only: how many tips to ask for (match a learned library)

    @field_validator("*")
    @classmethod
    def _same_rules_as_the_optimizer(cls, value, info):
        return check_knob(info.field_name, value) if info.field_name in KNOBS else value


def _knob_fields() -> dict:
    """The knobs a file can hold, as pydantic fields with the optimizer's types and defaults."""
    # a file holds text: learning_path is a name there (an instance is the Python API's alone), and the knobs set
    # elsewhere (the reflection LM) are left out; so the names their hints use need not be loaded (DSPy)
    types = get_type_hints(Knobs, localns={"LearningPath": str, "dspy": SimpleNamespace(BaseLM=object)})
    return {name: (types[name], knob.default) for name, knob in KNOBS.items() if name not in SET_ELSEWHERE}


OptimizerConfig = create_model("OptimizerConfig", __base__=_OptimizerSection, __module__=__name__, **_knob_fields(),
                               __doc__="The [optimizer] section: TrainingFreeGRPO's knobs (src/tfgrpo/optimizers/knobs.py), "
                                       "checked by the same rules as its constructor, and the CLI's own keys.")


class EvaluateConfig(_Strict):
    num_runs: int = Field(1, ge=1)  # k runs per problem (Mean@k, Pass@k)
    num_threads: int = Field(4, ge=1)
    seed: int = 0  # bootstrap seed


class TrackingConfig(_Strict):
    """MLflow tracking of compile and evaluation (`pip install -e ".[mlflow]"`): one run per run_dir, resumed."""

    enabled: bool = True  # the section turns tracking on; false turns it off again
    tracking_uri: str | None = None  # default: a SQLite store in run_dir/mlflow (`mlflow ui --backend-store-uri ...`)
    experiment: str = Field("tfgrpo", min_length=1)  # the MLflow experiment the run goes into


class Config(_Strict):
    policy: LMConfig = LMConfig()
    reflection: LMConfig | None = None  # None: the policy LM also makes the learning calls
    judge: LMConfig | None = None  # the web task's LLM judge; None: the reflection LM (else the policy LM)
    task: TaskConfig = TaskConfig()
    web: WebConfig = WebConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    tracking: TrackingConfig | None = None  # MLflow; None: nothing is logged and MLflow is not imported
    run_dir: str = "runs/default"  # compiled program, library, stats, plots and evaluations go here

    def reflection_config(self) -> LMConfig:
        """The LM of the learning calls: [reflection], else the policy LM."""
        return self.reflection or self.policy

    def judge_config(self) -> LMConfig:
        """The web task's judge: [judge], else the reflection LM (else the policy LM)."""
        return self.judge or self.reflection_config()

    def unset_keys(self) -> dict[str, str]:
        """Each LM section's api_key_env whose variable is not set, as {"policy.api_key_env": "OPENAI_API_KEY"}: what a
        dry run, loaded without them, says a run will need."""
        sections = {"policy": self.policy, "reflection": self.reflection, "judge": self.judge}
        return {f"{name}.api_key_env": lm.api_key_env for name, lm in sections.items()
                if lm is not None and lm.api_key_env and lm.api_key_env not in os.environ}

    def optimizer_knobs(self) -> dict:
        """The [optimizer] section as `TrainingFreeGRPO` keyword arguments (the direct baseline's keys left out), with
        `constrained_decoding = "auto"` resolved for the reflection LM's backend."""
        knobs = self.optimizer.model_dump(include=set(KNOBS), exclude_unset=True)  # the rest: the `auto` preset's
        if knobs.get("constrained_decoding", "auto") == "auto":
            knobs["constrained_decoding"] = self.reflection_config().constrained_mode or "auto"
        return knobs

    @classmethod
    def load(cls, path: str | Path, *, need_keys: bool = True) -> "Config":
        """The config in the TOML file at `path`, validated; a ConfigError with one line per invalid key. With
        `need_keys=False` (a dry run, which calls nothing) an api_key_env whose variable is not set is accepted."""
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such config file") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML ({exc})") from None
        try:
            return cls.model_validate(data, context={"need_keys": need_keys})
        except ValidationError as exc:
            keys_only = all(e["type"] == "missing_key" for e in exc.errors())  # a valid file, an environment without
            said = "an API key it needs is not in the environment" if keys_only else "invalid config"  # (its key)
            raise ConfigError(f"{path}: {said}\n  " + "\n  ".join(map(_line, exc.errors()))) from None


# Optional keys whose None has a name of its own in a file; any other optional key is None where it is left out.
NONE_IN_TOML = {"auto": "off"}


def _line(error: dict) -> str:
    """One line for a pydantic error that names the key: "optimizer.auto must be ..." where the message starts with
    the key's own name, else "policy.max_tokens: Input should be ..."."""
    loc = [str(part) for part in error["loc"]]
    message = " ".join(_message(error).split())
    if loc and message.startswith(f"{loc[-1]} "):
        return ".".join(loc[:-1] + [message])
    return f"{'.'.join(loc) or '(top)'}: {message}"


def _message(error: dict) -> str:
    """pydantic's message in a config file's terms (without its "Value error, " prefix, with no None, which TOML
    cannot write), or for a misspelled key the closest field names ("did you mean num_generations?")."""
    if error["type"] != "extra_forbidden":
        return _in_toml(error["msg"].removeprefix("Value error, "), str(error["loc"][-1]) if error["loc"] else "")
    *section, key = error["loc"]
    fields = _fields_of(section)
    close = difflib.get_close_matches(str(key), fields, n=2, cutoff=0.6)
    where = f"[{'.'.join(map(str, section))}]" if section else "the top level"
    hint = f"did you mean {' or '.join(close)}?" if close else f"the keys of {where}: {', '.join(fields)}"
    return f"unknown key; {hint} (every key: tfgrpo config --reference)"


def _in_toml(message: str, key: str) -> str:
    """A message written for the Python API ("must be None or ...", `auto=None`) as a TOML file says it: None is
    `NONE_IN_TOML`'s word for the key (auto = "off"), else the key left out."""
    if "None" not in message:
        return message
    if word := NONE_IN_TOML.get(key):
        listed = f"'{word}'" in message  # among the values the message lists already
        message = message.replace("must be None or ", "must be " if listed else f'must be "{word}" or ')
        return message.replace(f"{key}=None", f'{key} = "{word}"')
    if "must be None or " in message:
        message = message.replace("must be None or ", "must be ") + "; or remove the key (its value is then None)"
    return message


def _fields_of(section: list) -> list[str]:
    """The field names of the config model at `section` (["optimizer"], [] for the top level)."""
    model: type[BaseModel] | None = Config
    for part in section:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        candidates = (field.annotation, *get_args(field.annotation)) if field else ()
        model = next((c for c in candidates if isinstance(c, type) and not get_args(c) and issubclass(c, BaseModel)),
                     None)
        if model is None:
            return []
    return list(model.model_fields)


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and the fields."""
