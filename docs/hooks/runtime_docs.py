"""griffe extension: the API page shows `TrainingFreeGRPO` as `help(TrainingFreeGRPO)` does.

Its knobs are declared once, in src/tfgrpo/optimizers/knobs.py. Importing the class fills in its docstring's Args (one
entry per knob) and its constructor's defaults from that declaration, so the source griffe reads has no docstring
literal and `knob(...)` calls where the defaults go. This extension imports the class and hands griffe the docstring
and the defaults Python has. mkdocs.yml registers it after griffe's dataclasses extension, which makes the
constructor's signature from the fields.
"""

from __future__ import annotations

import inspect
from typing import Any

import griffe

CLASS = "optimizers.training_free_grpo.TrainingFreeGRPO"  # inside the tfgrpo package


class RuntimeDocs(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name != "tfgrpo":
            return
        from tfgrpo.optimizers.training_free_grpo import TrainingFreeGRPO

        cls = pkg[CLASS]  # its docstring is assigned (`__doc__ = DOC + args_doc()`), so the source shows none
        # warn_missing_types: the knobs' types are in their declaration (and the usage page's table), not annotated on
        # the signature Python builds from it
        cls.docstring = griffe.Docstring(inspect.getdoc(TrainingFreeGRPO), lineno=cls.lineno, endlineno=cls.endlineno,
                                         parent=cls, parser="google", parser_options={"warn_missing_types": False})
        signature = inspect.signature(TrainingFreeGRPO).parameters
        for param in cls.members["__init__"].parameters:
            if param.name in signature and signature[param.name].default is not inspect.Parameter.empty:
                param.default = repr(signature[param.name].default)
            if param.name in signature and signature[param.name].annotation is not inspect.Parameter.empty:
                param.annotation = signature[param.name].annotation  # (the knob's type, as declared)
        _no_builtin_docstrings(pkg)


# what Python's own types say of themselves: never an attribute's docstring (griffe reads an attribute whose value
# is a plain bool, int, str or tuple as documented by its type's docstring)
BUILTIN = {inspect.getdoc(t) for t in (bool, int, float, str, bytes, tuple, list, dict, set, frozenset, type(None),
                                      str.format)}


def _no_builtin_docstrings(obj: griffe.Object) -> None:
    for member in obj.members.values():
        if member.is_alias:
            continue
        if member.docstring is not None and inspect.cleandoc(member.docstring.value) in BUILTIN:
            member.docstring = None
        if member.is_module or member.is_class:
            _no_builtin_docstrings(member)
