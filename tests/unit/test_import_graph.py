"""The shape of megazero's imports: no cycles anywhere (function-level imports count), and zero/'s
files import only downward through the layers its README's table names."""

from __future__ import annotations

import pathlib
import re

from tests.import_graph import cycles, import_graph, package_sources

ROOT = pathlib.Path(__file__).resolve().parents[2]
ZERO_README = ROOT / "megazero" / "zero" / "README.md"


def _megazero_graph(extra: dict[str, str] | None = None) -> dict[str, set[str]]:
    sources, packages = package_sources(ROOT, "megazero")
    for name, text in (extra or {}).items():
        sources[name] = sources[name] + text
    return import_graph(sources, packages)


def test_megazero_has_no_import_cycle():
    assert cycles(_megazero_graph()) == []


def test_a_function_level_import_that_closes_a_cycle_is_found():
    # protocol.py is imported by every state; a function in it importing the factory closes a circle
    added = "\n\ndef _late():\n    from megazero.zero.factory import build_data_parallel_state  # noqa: F401\n"
    found = cycles(_megazero_graph({"megazero.zero.protocol": added}))
    assert any({"megazero.zero.protocol", "megazero.zero.factory"} <= set(cycle) for cycle in found), found


def test_type_checking_imports_do_not_count():
    graph = import_graph({"p.a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import p.b\n",
                          "p.b": "import p.a\n"})
    assert graph == {"p.a": set(), "p.b": {"p.a"}}


def _layers() -> dict[str, int]:
    """{module of megazero.zero: its layer} from the README's layer table."""
    layer_of = {}
    for line in ZERO_README.read_text().splitlines():
        row = re.match(r"\|\s*(\d+)\s*\|[^|]*\|(.*)\|\s*$", line)
        if row:
            for file in re.findall(r"`([\w/]+)\.py`", row.group(2)):
                name = "megazero.zero" if file == "__init__" else f"megazero.zero.{file.replace('/', '.')}"
                assert name not in layer_of, f"{file}.py is in two layers of {ZERO_README.name}"
                layer_of[name] = int(row.group(1))
    return layer_of


def test_every_zero_file_has_a_layer():
    sources, _ = package_sources(ROOT, "megazero")
    zero = {m for m in sources if m == "megazero.zero" or m.startswith("megazero.zero.")}
    layers = _layers()
    missing = ", ".join(m.rpartition(".")[2] + ".py" for m in sorted(zero - set(layers)))
    assert not missing, f"put {missing} in a layer of the table in {ZERO_README}"
    assert set(layers) - zero == set(), f"the layer table of {ZERO_README} names files that do not exist"


def test_zero_imports_run_down_the_layers():
    layers = _layers()
    upward = [f"{a} (layer {layers[a]}) imports {b} (layer {layers[b]})"
              for a, imported in sorted(_megazero_graph().items()) if a in layers
              for b in sorted(imported) if b in layers and layers[b] > layers[a]]
    assert upward == []
