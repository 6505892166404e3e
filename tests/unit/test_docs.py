"""The manual is tested like code: README.md and docs/ name only things that exist.

Checked in every page (README.md, docs/*.md, models/README.md, ci/README.md):
- every repository path in inline code, code blocks and links exists (a `*` must match something,
  `<name>` is a placeholder, `file.py::test` and `file.py:12` name the file);
- every `make X` is a Makefile target;
- every `--flag` after `scripts/X.py` or `benchmarks/X.py` (or after a launcher, or inside a recipe
  target's `ARGS="..."`) is listed by that script's `--help`;
- every dotted engine-config key in inline code (`zero_optimization.overlap_comm`) is in the schema,
  and every ```json block that looks like an engine config validates;
- every docs/ page is linked from README.md.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PAGES = sorted(
    ["README.md", "models/README.md", "ci/README.md"]
    + [os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md"))])

# where a path named in the manual lives: a token starting with one of these is a repository path
REPO_DIRS = ("megazero/", "models/", "scripts/", "configs/", "docs/", "tests/", "benchmarks/", "ci/", ".ci/")
REPO_FILES = ("Makefile", "README.md", "CHANGELOG.md", "pyproject.toml", "requirements.txt")
# directories a run writes: paths under them are outputs, not repository files
OUTPUT_DIRS = ("checkpoints/", "runs/", "data/", "hf/", "logs/", "wandb/", ".venv/", "/", "~", "$", ".cache/")
SOURCE_SUFFIXES = (".py", ".json", ".sh", ".sbatch", ".bash", ".md", ".toml", ".cpp", ".cu", ".h", ".yaml")

# the launchers and make targets that pass their flags through to a recipe script
RECIPE_OF = {f"scripts/pretrain_{name}.{kind}": f"scripts/pretrain_{recipe}.py"
             for name, recipe in (("gpt2", "gpt"), ("llama", "llama"), ("bert", "bert")) for kind in ("sh", "sbatch")}
MAKE_RECIPE = {"pretrain-gpt2": "scripts/pretrain_gpt.py", "pretrain-llama": "scripts/pretrain_llama.py",
               "pretrain-bert": "scripts/pretrain_bert.py"}

FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`]+)`")  # a span may wrap onto the next line
LINK = re.compile(r"\]\(([^)\s]+)\)")
PATH_TOKEN = re.compile(r"(?<![\w./-])((?:\.ci|megazero|models|scripts|configs|docs|tests|benchmarks|ci)/[\w./*<>-]*)")
COMMAND = re.compile(r"((?:scripts|benchmarks)/[\w-]+\.(?:py|sh|sbatch))([^|;&#>`]*)")
MAKE_ARGS = re.compile(r"\bmake\s+(pretrain-[\w-]+)[^`\n]*?ARGS=([\"'])(.*?)\2")
FLAG = re.compile(r"(?<![\w-])(--[A-Za-z][\w-]*)")
DOTTED_KEY = re.compile(r"^[a-z][a-z0-9_]*(?:\.[a-z0-9_]+)+$")


def read(page: str) -> str:
    with open(os.path.join(REPO, page)) as f:
        return f.read()


def split_code(text: str) -> tuple[list[tuple[str, str]], list[str]]:
    """The page's fenced blocks as (language, body, continuation lines joined) and its inline code spans."""
    blocks = [(lang, m.replace("\\\n", " ")) for lang, m in FENCE.findall(text)]
    prose = FENCE.sub("", text)
    return blocks, [" ".join(span.split()) for span in INLINE.findall(prose) if "\n\n" not in span]


def code_texts(page: str) -> list[str]:
    blocks, spans = split_code(read(page))
    return [body for _, body in blocks] + spans


def existing(path: str) -> bool:
    """Whether a named repository path exists (a glob must match; a trailing `/` must be a folder)."""
    path = re.sub(r"::.*$", "", path)
    path = re.sub(r":\d+(-\d+)?$", "", path).rstrip(".,;:)")
    if "*" in path:
        return bool(glob.glob(os.path.join(REPO, path)))
    full = os.path.join(REPO, path)
    return os.path.isdir(full) if path.endswith("/") else os.path.exists(full)


def named_paths(page: str) -> set[str]:
    """Repository paths the page names in code, and the targets of its relative links (repo-relative)."""
    text = read(page)
    found = set()
    for code in code_texts(page):
        for token in PATH_TOKEN.findall(code):
            if "<" not in token and ">" not in token:
                found.add(token.rstrip(".,;:)"))
    _, spans = split_code(text)
    for span in spans:
        token = span.strip()
        if token in REPO_FILES:
            found.add(token)
        # a source file written relative to somewhere else (`zero/sharded.py` for megazero/zero/sharded.py)
        elif (re.fullmatch(r"[\w./*-]+/[\w.*-]+", token) and token.endswith(SOURCE_SUFFIXES)
              and not token.startswith(OUTPUT_DIRS) and not token.startswith("..")):
            found.add(token)
    base = os.path.dirname(page)
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        target = target.split("#")[0]
        found.add(os.path.normpath(os.path.join(base, target)) + ("/" if target.endswith("/") else ""))
    return found


def test_named_paths_exist():
    missing = [f"{page}: `{path}`" for page in PAGES for path in sorted(named_paths(page)) if not existing(path)]
    assert not missing, "the manual names paths that do not exist:\n" + "\n".join(missing)


@functools.cache
def make_targets() -> frozenset[str]:
    targets = set()
    for line in read("Makefile").splitlines():
        m = re.match(r"^([A-Za-z][\w./ -]*?)\s*:(?!=)", line)
        if m:
            targets.update(m.group(1).split())
    return frozenset(targets)


def test_make_targets_exist():
    named = {(page, target) for page in PAGES for code in code_texts(page)
             for target in re.findall(r"(?<![\w-])make\s+([a-z][\w-]*)", code)}
    missing = [f"{page}: `make {t}`" for page, t in sorted(named) if t not in make_targets()]
    assert not missing, "the manual names make targets the Makefile lacks:\n" + "\n".join(missing)


def flags_named(page: str) -> set[tuple[str, str]]:
    """(script, flag) for every flag the page passes to a script, a launcher or a recipe's make target."""
    named = set()
    for code in code_texts(page):
        for line in code.splitlines() or [code]:
            for script, rest in COMMAND.findall(line):
                script = RECIPE_OF.get(script, script)
                if script.endswith(".py"):
                    named.update((script, flag) for flag in FLAG.findall(rest))
            for target, _, args in MAKE_ARGS.findall(line):
                if target in MAKE_RECIPE:
                    named.update((MAKE_RECIPE[target], flag) for flag in FLAG.findall(args))
    return named


# runs each script as `python <script> --help` would, in one interpreter (torch imported once),
# printing {"script", "code", "out"} per script as a JSON line
HELP_RUNNER = """
import contextlib, io, json, runpy, sys
for script in sys.argv[1:]:
    sys.argv = [script, "--help"]
    out, code = io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code or 0
        except Exception as e:  # a script that fails before its parser: the test names it
            print(repr(e))
            code = 1
    print(json.dumps({"script": script, "code": code, "out": out.getvalue()}), flush=True)
"""


def help_flags(scripts: list[str]) -> dict[str, frozenset[str]]:
    """{script: the flags `python <script> --help` lists (aliases included)}."""
    out = subprocess.run([sys.executable, "-c", HELP_RUNNER, *scripts], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    known = {}
    for line in out.stdout.splitlines():
        if line.startswith('{"script"'):
            result = json.loads(line)
            assert result["code"] == 0, f"`python {result['script']} --help` failed:\n{result['out'][-2000:]}"
            known[result["script"]] = frozenset(FLAG.findall(result["out"]))
    assert sorted(known) == sorted(scripts), (sorted(known), out.stderr[-3000:])
    return known


def test_script_flags_exist():
    named = {(page, script, flag) for page in PAGES for script, flag in flags_named(page)}
    scripts = sorted({script for _, script, _ in named})
    missing_scripts = [s for s in scripts if not os.path.exists(os.path.join(REPO, s))]
    assert not missing_scripts, f"the manual runs scripts that do not exist: {missing_scripts}"
    known = help_flags(scripts)
    missing = [f"{page}: `{script} {flag}`" for page, script, flag in sorted(named) if flag not in known[script]]
    assert not missing, "the manual passes flags the scripts do not define:\n" + "\n".join(missing)


@functools.cache
def engine_schema() -> dict:
    with open(os.path.join(REPO, "configs", "megazero.schema.json")) as f:
        return json.load(f)


def _branches(node: dict) -> list[dict]:
    """A schema node with its $ref resolved and its anyOf/oneOf/allOf alternatives spread out."""
    schema = engine_schema()
    if "$ref" in node:
        node = schema["$defs"][node["$ref"].split("/")[-1]]
    alternatives = node.get("anyOf", []) + node.get("oneOf", []) + node.get("allOf", [])
    if not alternatives:
        return [node]
    return [node] + [b for alt in alternatives for b in _branches(alt)]


def key_in_schema(key: str) -> bool:
    """Whether a dotted key (`zero_optimization.offload_param.device`) is a path through the schema."""
    nodes = [engine_schema()]
    for part in key.split("."):
        nxt = []
        for node in nodes:
            for branch in _branches(node):
                props = branch.get("properties", {})
                if part in props:
                    nxt.append(props[part])
                # `optimizer.params.<key>`: every optimizer's and schedule's params model is a candidate
                if part == "params" and "type" in props:
                    nxt.extend({"$ref": f"#/$defs/{name}"} for name in engine_schema()["$defs"]
                               if name.endswith("Params"))
        if not nxt:
            return False
        nodes = nxt
    return True


def test_config_keys_exist():
    top = set(engine_schema()["properties"])
    missing = []
    for page in PAGES:
        _, spans = split_code(read(page))
        for span in spans:
            key = span.strip()
            if DOTTED_KEY.match(key) and key.split(".")[0] in top and not key_in_schema(key):
                missing.append(f"{page}: `{key}`")
    assert not missing, "the manual names config keys the schema lacks:\n" + "\n".join(missing)


def test_json_configs_validate():
    from megazero.config import ConfigError, validate_config

    top = set(engine_schema()["properties"])
    bad = []
    for page in PAGES:
        blocks, _ = split_code(read(page))
        for lang, body in blocks:
            if lang != "json":
                continue
            try:
                raw = json.loads(body)
            except json.JSONDecodeError as e:
                bad.append(f"{page}: a json block does not parse ({e}):\n{body[:200]}")
                continue
            if isinstance(raw, dict) and set(raw) & top:
                try:
                    validate_config(raw)
                except ConfigError as e:
                    bad.append(f"{page}: a config block does not validate: {e}")
    assert not bad, "\n".join(bad)


def test_every_docs_page_is_linked_from_the_readme():
    linked = {os.path.normpath(t.split("#")[0]) for t in LINK.findall(read("README.md"))}
    pages = [p for p in PAGES if p.startswith("docs/")]
    assert pages, "docs/ has no pages"
    unlinked = [p for p in pages if p not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_no_history_in_the_manual():
    history = re.compile(r"\bsessions?\s\d+|before\sthe\schange|not\scommitted", re.I)
    found = [f"{page}: {line.strip()[:120]}" for page in PAGES for line in read(page).splitlines()
             if history.search(line)]
    assert not found, "the manual tells history (it belongs in CHANGELOG.md):\n" + "\n".join(found)


@pytest.mark.parametrize("checker, page_text, broken", [
    (named_paths, "see `megazero/no_such_module.py`", "megazero/no_such_module.py"),
    (named_paths, "see `zero/no_such_file.py`", "zero/no_such_file.py"),
    (named_paths, "[a page](docs/no_such_page.md)", "docs/no_such_page.md"),
    (flags_named, "```bash\npython scripts/generate.py \\\n  --no-such-flag 1\n```",
     ("scripts/generate.py", "--no-such-flag")),
    (flags_named, '`make pretrain-gpt2 ARGS="--no-such-flag 1"`', ("scripts/pretrain_gpt.py", "--no-such-flag")),
    (flags_named, "`sbatch scripts/pretrain_gpt2.sh --no-such-flag`", ("scripts/pretrain_gpt.py", "--no-such-flag")),
])
def test_the_checks_find_what_they_are_for(tmp_path, monkeypatch, checker, page_text, broken):
    """Each extractor finds the broken reference in a page written for the purpose."""
    page = tmp_path / "page.md"
    page.write_text(page_text)
    monkeypatch.setattr(sys.modules[__name__], "read", lambda _: page.read_text())
    assert broken in checker("page.md")
    if checker is named_paths:
        assert not existing(broken)


def test_an_unknown_config_key_is_found():
    assert key_in_schema("zero_optimization.offload_param.device")
    assert key_in_schema("optimizer.params.lr")
    assert not key_in_schema("zero_optimization.no_such_key")


def anchors(page: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+\s+(.*)$", FENCE.sub("", read(page)), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_link_anchors_exist():
    broken = []
    for page in PAGES:
        for target in LINK.findall(FENCE.sub("", read(page))):
            if "#" not in target or re.match(r"^[a-z]+:", target):
                continue
            path, anchor = target.split("#", 1)
            linked = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if linked.endswith(".md") and os.path.exists(os.path.join(REPO, linked)) and anchor not in anchors(linked):
                broken.append(f"{page}: ({target})")
    assert not broken, "links to headings that do not exist:\n" + "\n".join(broken)
