"""DeepSpeed's deprecated ZeRO switches, read as the blocks that replace them (as DeepSpeed reads them).

`zero_optimization.cpu_offload: true` is `offload_optimizer: {"device": "cpu"}` and
`cpu_offload_param: true` is `offload_param: {"device": "cpu"}`; false leaves the block as given.
Each one given warns once, naming the block to write instead.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

from megazero.config_fields import config_error

_REPLACED_BY = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}


def deprecated_offload_switches(raw: dict[str, Any]) -> dict[str, Any]:
    """The `zero_optimization` block `raw` with the deprecated switches replaced by their blocks."""
    raw = dict(raw)
    for old, new in _REPLACED_BY.items():
        if old not in raw:
            continue
        value = raw.pop(old)
        if value is None:
            continue
        if not isinstance(value, bool):
            raise config_error(f"'{{path}}' must be bool, got {type(value).__name__} {value!r}", old)
        if value and raw.get(new) is not None:
            raise config_error(f"'{{path}}' (deprecated) and '{{where}}{new}' are both given; keep '{{where}}{new}'",
                               old)
        if value:
            raw[new] = {"device": "cpu"}
        read_as = f"'{new}': {json.dumps(raw[new])}" if value else "nothing (false is the default)"
        warnings.warn(f"'zero_optimization.{old}' is deprecated (in DeepSpeed too): read as {read_as}; write "
                      f"'zero_optimization.{new}' instead", stacklevel=2)
    return raw
