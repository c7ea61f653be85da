"""Strict YAML reading: one document, string keys, no duplicate keys, every problem with its YAML path.

PyYAML's safe loader silently keeps the last of two equal keys (``ctx_len: 4096`` then
``ctx_len: 8192`` gives 8192), which hides typos in hand-edited specs. Here the document is first
composed into nodes, the node tree is walked once to find duplicate and non-string keys (reported
by YAML path, like every other spec problem), and only then constructed into Python objects.

Anchors and aliases (``&a`` / ``*a``) are refused before anything is composed: nine levels of
nine aliases are a few hundred bytes of text but 9**9 values once constructed (the "billion
laughs"), and a spec never needs them. Values go into messages through
:func:`qeff_vision.errors.shown`, which bounds their length whatever their size.

Size and nesting are bounded before PyYAML sees the text (:func:`bounds_problem`): its scanner
does work proportional to the nesting depth for every token, so a spec nested 100,000 levels
deep (200 KB of brackets) keeps it busy for minutes. A spec is a few KB, a few levels deep.
"""

from __future__ import annotations

import yaml

from qeff_vision.errors import shown

__all__ = ["MAX_BYTES", "MAX_DEPTH", "bounds_problem", "load_strict_yaml", "shown", "yaml_path"]

MAX_BYTES = 1 << 20  # the largest spec in specs/ is 2.4 KB
MAX_DEPTH = 32  # levels of nested mappings and lists (specs use 4)
# A quote opens a quoted scalar only where a token starts (not the apostrophe in `it's`).
_TOKEN_START = " \t[{,:-?"


def yaml_path(parent: str, key: str | int) -> str:
    """Child path in the notation problems use: ``vision.images[1].height``."""
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else str(key)


def _where(mark: yaml.Mark | None) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "unknown position"


def _scalar_key(node: yaml.Node) -> str | None:
    """The key text of a plain string scalar, or None for any other kind of key."""
    if isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:str":
        return node.value
    return None


def _key_problems(root: yaml.Node) -> list[str]:
    """Duplicate and non-string mapping keys anywhere under ``root``, each once (aliases are shared)."""
    problems: list[str] = []
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, str]] = [(root, "")]
    while stack:
        node, path = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((child, yaml_path(path, index)) for index, child in enumerate(node.value))
        elif isinstance(node, yaml.MappingNode):
            keys: dict[str, yaml.Node] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = _scalar_key(key_node)
                here = path or "<top level>"
                if key is None:
                    text = key_node.value if isinstance(key_node, yaml.ScalarNode) else "a collection"
                    problems.append(f"{here}: key {text!r} must be a string ({_where(key_node.start_mark)})")
                    continue
                if key in keys:
                    first = keys[key].start_mark.line + 1
                    problems.append(
                        f"{yaml_path(path, key)}: duplicate key (first at line {first}, "
                        f"again at {_where(key_node.start_mark)})"
                    )
                    continue
                keys[key] = key_node
                stack.append((value_node, yaml_path(path, key)))
    return sorted(problems)


def _alias_problem(loader: yaml.SafeLoader) -> str | None:
    """The first anchor or alias in the document's events, as a problem, or None.

    Reads only the event stream (linear in the text), so it answers before any alias is expanded.
    """
    while loader.check_event():
        event = loader.get_event()
        if isinstance(event, yaml.AliasEvent):
            return f"YAML alias *{event.anchor[:40]} is not allowed in a spec ({_where(event.start_mark)})"
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            return f"YAML anchor &{anchor[:40]} is not allowed in a spec ({_where(event.start_mark)})"
    return None


def _skip_quoted(line: str, start: int) -> int:
    """Index after the quoted scalar opening at ``start`` (the line's end if it runs on)."""
    quote, index = line[start], start + 1
    while index < len(line):
        if quote == '"' and line[index] == "\\":
            index += 2
            continue
        if line[index] == quote:
            if quote == "'" and line[index + 1 : index + 2] == "'":  # '' is a quote inside '...'
                index += 2
                continue
            return index + 1
        index += 1
    return index


def bounds_problem(text: str) -> str | None:
    """The document's size or nesting beyond :data:`MAX_BYTES` / :data:`MAX_DEPTH`, or None.

    One pass over the text, no YAML parsing: flow brackets outside quotes and comments, block
    levels by indentation (and ``- `` markers opening a nested list on the same line). It may
    count a level too many (a multi-line quoted scalar), never one too few.
    """
    if len(text) > MAX_BYTES:
        return f"the spec is {len(text):,} characters; a spec is at most {MAX_BYTES:,}"
    flow = 0
    indents: list[int] = []
    for number, line in enumerate(text.splitlines(), 1):
        body = line.lstrip(" ")
        if flow == 0 and body and not body.startswith("#"):
            indent = len(line) - len(body)
            while indents and indents[-1] >= indent:
                indents.pop()
            indents.append(indent)
            dashes = 0
            while body.startswith("- "):
                body = body[2:].lstrip(" ")
                dashes += 1
            if len(indents) + dashes > MAX_DEPTH:
                return f"the spec nests more than {MAX_DEPTH} levels deep (line {number})"
        index = 0
        while index < len(line):
            char = line[index]
            at_token = index == 0 or line[index - 1] in _TOKEN_START
            if char in "'\"" and at_token:
                index = _skip_quoted(line, index)
                continue
            if char == "#" and at_token:
                break
            if char in "[{":
                flow += 1
                if flow + len(indents) > MAX_DEPTH:
                    return f"the spec nests more than {MAX_DEPTH} levels deep (line {number})"
            elif char in "]}":
                flow = max(flow - 1, 0)
            index += 1
    return None


def load_strict_yaml(text: str) -> tuple[object, list[str]]:
    """Parse one YAML document strictly.

    Args:
        text: The document.

    Returns:
        The constructed data (``None`` when there were problems or the document is empty) and the
        problems found: syntax errors with their position, anchors and aliases, duplicate keys
        and non-string keys with their YAML path. Never raises for bad input.
    """
    bounds = bounds_problem(text)
    if bounds is not None:
        return None, [bounds]
    loader = None
    try:
        loader = yaml.SafeLoader(text)
        alias = _alias_problem(loader)
        if alias is not None:
            return None, [alias]
        loader.dispose()
        loader = yaml.SafeLoader(text)
        node = loader.get_single_node()
        if node is None:
            return None, []
        problems = _key_problems(node)
        if problems:
            return None, problems
        return loader.construct_document(node), []
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        message = " ".join(part for part in (exc.context, exc.problem) if part)
        return None, [f"YAML syntax: {message} ({_where(mark)})"]
    except yaml.YAMLError as exc:
        return None, [f"YAML syntax: {' '.join(str(exc).split())}"]
    except RecursionError:
        return None, ["YAML syntax: the document is nested too deeply"]
    finally:
        if loader is not None:
            loader.dispose()
