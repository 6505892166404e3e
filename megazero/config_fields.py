"""Value types for the config schema, shared by `megazero.config` and the optimizers' params models.

JSON has one number type, so the types here take what DeepSpeed's JSON files hold and refuse what
is a mistake: a float field takes ints (`"lr": 1`), an int field takes integral floats (`5e8`, as
JSON writers print large sizes), and neither takes a bool or a string.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


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


Float = Annotated[float, BeforeValidator(lambda v: _number(v, float))]
Int = Annotated[int, BeforeValidator(lambda v: _number(v, int))]
Bool = Annotated[bool, BeforeValidator(_bool)]
Str = Annotated[str, BeforeValidator(_str)]
Beta = Annotated[Float, Field(ge=0.0, lt=1.0)]
# JSON has no tuples: a two-element list is the pair, anything else is an error naming the length
Betas = Annotated[tuple[Beta, Beta], BeforeValidator(lambda v: tuple(v) if isinstance(v, list) else v)]


class Section(BaseModel):
    """A config block: unknown keys are errors, values are checked on assignment too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_default=True)
