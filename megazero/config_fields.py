"""Value types for the config schema, shared by `megazero.config` and the optimizers' params models.

JSON has one number type, so the types here take what DeepSpeed's JSON files hold and refuse what
is a mistake: a float field takes ints (`"lr": 1`), an int field takes integral floats (`5e8`, as
JSON writers print large sizes), and neither takes a bool or a string.

The second half turns pydantic's errors into one line that names the full key path and the value
given (`'optimizer.params.betas' must be a list of 2 numbers, got [0.9]`): `error_message` for a
top-level model, `validate_nested` for a block validated inside another (the per-type params).
"""

from __future__ import annotations

import difflib
import re
import typing
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WithJsonSchema
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails, PydanticCustomError


def _number(value: Any, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"must be {kind.__name__}, got {type(value).__name__} {value!r}")
    if kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"must be int, got float {value!r}")
        return int(value)
    return float(value)


def _bool(value: Any) -> Any:
    if not isinstance(value, bool):
        raise ValueError(f"must be bool, got {type(value).__name__} {value!r}")
    return value


def _str(value: Any) -> Any:
    if not isinstance(value, str):
        raise ValueError(f"must be str, got {type(value).__name__} {value!r}")
    return value


def _pair(value: Any) -> Any:
    # JSON has no tuples: a two-element list is the pair, anything else is an error naming the length
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"must be a list of 2 numbers [beta1, beta2], got {type(value).__name__} {value!r}")
    return tuple(value)


def _non_negative(value: Any) -> float:
    value = _number(value, float)
    if value < 0:
        raise ValueError(f"must be >= 0, got {value!r}")
    return value


def _non_negative_floats(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        try:
            return [_non_negative(v) for v in value]
        except ValueError as e:
            raise ValueError(f"{e} in {list(value)!r}") from None
    return _non_negative(value)


Float = Annotated[float, BeforeValidator(lambda v: _number(v, float))]
Int = Annotated[int, BeforeValidator(lambda v: _number(v, int))]
Bool = Annotated[bool, BeforeValidator(_bool)]
Str = Annotated[str, BeforeValidator(_str)]
Beta = Annotated[Float, Field(ge=0.0, lt=1.0)]
Betas = Annotated[tuple[Beta, Beta], BeforeValidator(_pair)]
# one value for every param group, or a list with one per group (DeepSpeed's schedules take both)
NonNegativeFloats = Annotated[float | list[float], BeforeValidator(_non_negative_floats),
                              WithJsonSchema({"anyOf": [{"type": "number", "minimum": 0},
                                                        {"type": "array", "items": {"type": "number", "minimum": 0}}]})]


def int_choice(*choices: int) -> Any:
    """An int that must be one of `choices` (integral floats such as 2.0 are taken, as for Int)."""
    return Annotated[Literal[choices], BeforeValidator(lambda v: _number(v, int))]


def true_only(reason: str) -> Any:
    """A bool key megazero accepts only as true (`reason`: why false cannot be honoured)."""

    def check(value: Any) -> bool:
        if _bool(value) is not True:
            raise ValueError(f"false is not supported: {reason}, got {value!r}")
        return True

    return Annotated[bool, BeforeValidator(check), WithJsonSchema({"type": "boolean", "const": True})]


def any_case_pattern(names: Iterable[str]) -> str:
    """A JSON Schema (ECMA) regex matching any of `names` in any letter case."""
    alternatives = ("".join(f"[{c.upper()}{c.lower()}]" if c.isalpha() else c for c in name) for name in names)
    return "^(?:" + "|".join(alternatives) + ")$"


def any_case_choice(names: tuple[str, ...]) -> Any:
    """A string that must be one of `names` in any letter case; stored upper-cased."""

    def check(value: Any) -> str:
        if not isinstance(value, str) or value.upper() not in {n.upper() for n in names}:
            raise ValueError(f"must be one of {', '.join(names)} (any case), got {value!r}")
        return value.upper()

    schema = {"type": "string", "pattern": any_case_pattern(names), "examples": list(names)}
    return Annotated[str, BeforeValidator(check), WithJsonSchema(schema)]


class Section(BaseModel):
    """A config block: unknown keys are errors, values are checked on assignment too, and no float
    takes NaN or +-inf (a run would train on NaNs or never update: refused, naming the key)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_default=True, allow_inf_nan=False)


def suggest(key: str, valid: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the closest of `valid` to `key`, or '' when none is close."""
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else ""


def unknown_key(key: str, valid: Iterable[str]) -> str:
    """The template of the unknown-key message ('{path}' is the key's full path)."""
    valid = sorted(valid)
    return f"unknown key '{{path}}'{suggest(key, valid)}; valid keys: {', '.join(valid)}"


def config_error(template: str, *sub_loc: str | int) -> PydanticCustomError:
    """An error to raise inside a validator: `template` is the message with '{path}' for the full key
    path and '{where}' for its block's ('fp16.'), `sub_loc` the key below where pydantic reports it
    (a model validator is reported at its block; the key it is about is one level down)."""
    return PydanticCustomError("config", "{template}", {"template": template, "sub_loc": tuple(sub_loc)})


def field_keys(name: str, info: FieldInfo) -> list[str]:
    """The keys a field is given under: its name, or each of its validation aliases."""
    alias = info.validation_alias
    choices = getattr(alias, "choices", None)
    if choices:
        return [c for c in choices if isinstance(c, str)]
    return [alias] if isinstance(alias, str) else [name]


def one_spelling(model: type[BaseModel], raw: dict) -> dict:
    """`raw` unchanged, or a config error when it gives one field of `model` under two of its keys
    (DeepSpeed's `stage3_prefetch_bucket_size` and `prefetch_bucket_size`): pydantic would keep one
    of them silently."""
    for name, info in model.model_fields.items():
        given = [key for key in field_keys(name, info) if key in raw]
        if len(given) > 1:
            raise config_error(f"'{{where}}{given[0]}' and '{{where}}{given[1]}' are two spellings of one key; "
                               f"give one", given[0])
    return raw


def key_names(model: type[BaseModel]) -> list[str]:
    """The keys `model` accepts: field names, and every alias a field is validated under."""
    return [key for name, info in model.model_fields.items() for key in field_keys(name, info)]


def section_type(annotation: Any) -> type[BaseModel] | None:
    """The model class an annotation holds (`X`, `X | None`), or None for a plain value."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _model_at(root: type[BaseModel], loc: tuple) -> type[BaseModel]:
    model = root
    for part in loc:
        field = next((info for name, info in model.model_fields.items() if part in field_keys(name, info)), None)
        inner = section_type(field.annotation) if field is not None else None
        if inner is None:
            break
        model = inner
    return model


def dotted(loc: tuple) -> str:
    """('optimizer', 'params', 'betas', 0) -> 'optimizer.params.betas[0]'."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


_BOUNDS = {"greater_than_equal": ("ge", ">="), "greater_than": ("gt", ">"), "less_than_equal": ("le", "<="),
           "less_than": ("lt", "<")}


# what pydantic puts in an error's loc for the member of a union it tried ('float', 'list[float]'):
# not a key of the config
_UNION_MEMBER = re.compile(r"^(float|int|str|bool|(list|tuple|dict|function-\w+|constrained-\w+)\[.*\])$")


def _key_loc(error: ErrorDetails) -> tuple:
    return tuple(part for part in error["loc"] if not _UNION_MEMBER.match(str(part)))


def _first_error(exc: ValidationError) -> ErrorDetails:
    """The first error, or where the value failed every member of a union, the member's error that
    reached deepest into it (a list's bad element rather than 'not a float')."""
    errors = exc.errors()
    key = _key_loc(errors[0])
    same_key = [e for e in errors if _key_loc(e)[:len(key)] == key]
    return max(same_key, key=lambda e: len(_key_loc(e)))


def _describe(root: type[BaseModel], error: ErrorDetails) -> tuple[tuple, str]:
    """(full loc, message template) for one pydantic error."""
    loc = _key_loc(error)
    kind, ctx, given = error["type"], error.get("ctx", {}), error.get("input")
    got = f"got {type(given).__name__} {given!r}"
    if kind == "finite_number":
        return loc, f"'{{path}}' must be a finite number, got {given!r}"
    if kind == "config":
        return loc + tuple(ctx["sub_loc"]), ctx["template"]
    if kind == "extra_forbidden":
        return loc, unknown_key(str(loc[-1]), key_names(_model_at(root, loc[:-1])))
    if kind == "value_error":
        return loc, f"'{{path}}' {ctx['error']}"
    if kind in _BOUNDS:
        key, sign = _BOUNDS[kind]
        return loc, f"'{{path}}' must be {sign} {ctx[key]}, got {given!r}"
    if kind == "literal_error":
        return loc, f"'{{path}}' must be {ctx['expected']}, got {given!r}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return loc, f"'{{path}}' must be an object, {got}"
    if kind == "missing":
        return loc, "'{path}' is required (it has no default)"
    return loc, f"'{{path}}': {error['msg']}, {got}"


def render(template: str, loc: tuple) -> str:
    """Fill '{path}' and '{where}' into a message template (plain replace: values may hold braces)."""
    where = dotted(loc[:-1]) + "." if len(loc) > 1 else ""
    return template.replace("{path}", dotted(loc)).replace("{where}", where)


def error_message(root: type[BaseModel], exc: ValidationError) -> str:
    """The first error of `exc` (raised validating `root`) as one line naming the key path and value."""
    loc, template = _describe(root, _first_error(exc))
    return render(template, loc)


def validate_nested(model: type[BaseModel], value: Any, *sub_loc: str) -> BaseModel:
    """Validate `value` as `model` inside another validator, re-raising its first error so that the
    outer error names the full path (outer block + `sub_loc` + the key inside `model`)."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        loc, template = _describe(model, _first_error(exc))
        raise config_error(template, *sub_loc, *loc) from None


def validate_given(model: type[BaseModel], params: dict) -> dict:
    """`params` validated as `model`, keeping only the keys given (coerced: 5e1 -> 50, a list of betas ->
    a tuple), so that whoever builds from them keeps its own defaults for the rest."""
    checked = validate_nested(model, params)
    return {key: getattr(checked, key) for key in params}
