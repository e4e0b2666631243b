"""Constrained decoding for DSPy signatures: the backend may only emit the signature's JSON schema.

`ConstrainedJSONAdapter` is DSPy's `JSONAdapter` with the response format chosen by us instead of by
LiteLLM's model catalog, which does not know local or self-hosted model names:
- "json_object": `{"type": "json_object", "schema": ...}`, the form llama.cpp's servers (llama-cpp-python,
  llama-server) turn into a grammar;
- "json_schema": OpenAI's structured outputs form, understood by OpenAI, vLLM, SGLang and Ollama.
Literal fields become enums, so an illegal value cannot be sampled. In "json_object" mode a field's length
bounds (`dspy.OutputField(max_length=...)`) become `maxLength`/`minLength` in the grammar, so a small model
that repeats itself must close the string and go on to the next field instead of running into `max_tokens`
mid-object; strict "json_schema" backends reject length keywords, so that mode leaves them out. The reply is
still parsed and validated by DSPy as usual.
"""

from __future__ import annotations

from typing import Annotated, Literal

import dspy
import pydantic
from dspy.adapters.json_adapter import _get_structured_outputs_response_format

Mode = Literal["json_object", "json_schema"]


LENGTH_KEYS = ("minLength", "maxLength", "minItems", "maxItems")


def output_schema(signature: type[dspy.Signature], *, lengths: bool = False) -> dict:
    """The JSON schema of a signature's outputs: every field required, nothing else allowed, and with `lengths`
    the fields' length bounds."""
    schema = _get_structured_outputs_response_format(signature).model_json_schema()
    for name, field in signature.output_fields.items():
        if lengths and field.metadata and name in schema["properties"]:  # DSPy's builder drops constraints
            bounds = pydantic.TypeAdapter(Annotated[(field.annotation, *field.metadata)]).json_schema()
            schema["properties"][name].update({k: v for k, v in bounds.items() if k in LENGTH_KEYS})
    return schema


class ConstrainedJSONAdapter(dspy.JSONAdapter):
    def __init__(self, mode: Mode = "json_object"):
        if mode not in ("json_object", "json_schema"):
            raise ValueError(f"constrained decoding mode must be 'json_object' or 'json_schema', not {mode!r}")
        super().__init__()
        self.mode = mode
        self.use_json_adapter_fallback = False  # one reply per call: a reply that does not parse is an error

    def _prepare_response_format(self, lm, lm_kwargs, signature):
        schema = output_schema(signature, lengths=self.mode == "json_object")
        if self.mode == "json_object":
            lm_kwargs["response_format"] = {"type": "json_object", "schema": schema}
        else:
            lm_kwargs["response_format"] = {"type": "json_schema",
                                            "json_schema": {"name": "reply", "schema": schema, "strict": True}}
