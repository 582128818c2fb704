#!/usr/bin/env python3
"""Check a CRD's CEL rules the way a real kube-apiserver will, without one (CI runs this).

A real API server refuses a CRD that kmock and the offline schema validators accept:

* it evaluates every `x-kubernetes-validations` rule against its node's `default` *as
  written* (nested defaults are not applied first), so `default: {}` under a rule that reads
  `self.maxBackoffSeconds` fails with "no such key";
* it estimates each rule's and messageExpression's worst-case cost and refuses those over
  budget. Sizes come from the schema's `maxLength`, `maxItems` and `maxProperties`; the
  result of `string(x)` has no known size at all (cel-go's estimator, whatever `maximum`
  says), so `'...' + string(x)` is refused "by a factor of more than 100x".

The checks, one line per problem:

1. every rule and messageExpression compiles (cel-python);
2. every rule holds, without error, on its node's `default` as written, and on that default
   with the nested defaults applied; its messageExpression evaluates to a string there;
3. a non-empty object `default` is complete (applying the nested defaults changes nothing),
   so the two copies of a default cannot drift apart;
4. every rule holds on every sample CR (defaulted as the API server would);
5. every field a rule or messageExpression turns into a string (`string()`, `format()`),
   measures (`size()`) or iterates (`all`, `exists`, `map`, `filter`, ...) is bounded:
   `maximum` (or `enum`) for numbers, `maxLength` (or `enum`) for strings, `maxItems` for
   lists, `maxProperties` for maps;
6. no messageExpression joins `string(...)` with `+`; use `'... %d ...'.format([...])`.

Usage:
  python scripts/check_crd.py                    # crds/*.yaml against crds/samples/*.yaml
  python scripts/check_crd.py CRD.yaml [--samples DIR]
Exit status 1 when any problem is found.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path
from typing import Any, Iterator

import yaml

ROOT = Path(__file__).resolve().parents[1]

# Fields the API server bounds itself (ObjectMeta), though the CRD schema says only `object`.
SERVER_BOUNDED = {"metadata.name", "metadata.generateName"}
ITERATING = ("all", "exists", "exists_one", "map", "filter")
_PATH = r"self((?:\.[A-Za-z_][A-Za-z0-9_]*)*)"


# --- defaulting and walking ------------------------------------------------------------------


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Default a value the way the API server does for a structural schema: missing
    properties get their `default`, recursively, also inside defaulted values."""
    value = copy.deepcopy(value)
    if schema.get("type") == "object" and isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value:
                value[key] = apply_defaults(extra, value[key])
    elif schema.get("type") == "array" and isinstance(value, list):
        value = [apply_defaults(schema.get("items", {}), v) for v in value]
    return value


def walk_nodes(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (path, node) for every node of a structural schema, the root first."""
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from walk_nodes(sub, f"{path}.{key}")
    for key, suffix in (("items", "[]"), ("additionalProperties", "{}")):
        if isinstance(schema.get(key), dict):
            yield from walk_nodes(schema[key], f"{path}{suffix}")


def walk_validations(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (path, rule dict) for every x-kubernetes-validations rule in the schema."""
    for node_path, node in walk_nodes(schema, path):
        for rule in node.get("x-kubernetes-validations") or []:
            yield node_path, rule


def crd_schemas(crd: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(version name, openAPIV3Schema) of every version of a CRD."""
    for version in crd["spec"]["versions"]:
        yield version["name"], version["schema"]["openAPIV3Schema"]


# --- evaluating rules (cel-python) -----------------------------------------------------------


class RuleError(Exception):
    """A rule that does not evaluate to a boolean, or a messageExpression that does not
    evaluate to a string (e.g. "no such member": a field the value lacks)."""


def _format(template: Any, args: Any) -> Any:
    """CEL's `<string>.format(<list>)` (Kubernetes' strings library), for the clauses our
    rules use: %s, %d and %%. Any other clause is an error, never a silent pass."""
    import celpy

    args = list(args)
    out, i = [], 0
    for part in re.split(r"(%.)", str(template)):
        if part in ("%s", "%d"):
            if i >= len(args):
                raise ValueError(f"format: {template!r} needs more than {len(args)} arguments")
            value = args[i]
            i += 1
            if part == "%d" and not isinstance(value, int):
                raise ValueError(f"format: %d needs an integer, found {value!r}")
            out.append(str(int(value)) if part == "%d" else str(value))
        elif part == "%%":
            out.append("%")
        elif re.fullmatch(r"%.", part):
            raise ValueError(f"format: clause {part} is not supported by this checker")
        else:
            out.append(part)
    return celpy.celtypes.StringType("".join(out))


def evaluate(expression: str, value: Any, old: Any = None) -> Any:
    """Evaluate one CEL expression with `self` bound to `value` (JSON-like), and `oldSelf` to
    `old` when given (a transition rule on an update); raises RuleError."""
    import celpy

    env = celpy.Environment()
    bindings = {"self": celpy.json_to_cel(value)}
    if old is not None:
        bindings["oldSelf"] = celpy.json_to_cel(old)
    try:
        program = env.program(env.compile(expression), functions={"format": _format})
        return program.evaluate(bindings)
    except Exception as err:  # celpy raises CELEvalError / CELParseError / ValueError
        raise RuleError(f"{expression!r} on {_short(value)}: {err.args[0] if err.args else err}") from None


def _short(value: Any, limit: int = 100) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...}"



def is_transition_rule(rule: dict[str, Any]) -> bool:
    """A rule that reads `oldSelf`: the API server evaluates it on updates only."""
    return re.search(r"\boldSelf\b", rule["rule"]) is not None


def rule_failure(rule: dict[str, Any], value: Any, old: Any = None) -> str | None:
    """None when `rule` holds on `value` (a transition rule without `old`, i.e. on a create,
    always holds), else the message the API server would give."""
    import celpy

    if is_transition_rule(rule) and old is None:
        return None
    result = evaluate(rule["rule"], value, old)
    if not isinstance(result, (bool, celpy.celtypes.BoolType)):
        raise RuleError(f"{rule['rule']!r} on {_short(value)}: gave {result!r}, not a boolean")
    if bool(result):
        return None
    return message_of(rule, value)


def message_of(rule: dict[str, Any], value: Any) -> str:
    """The rule's message: its messageExpression evaluated on `value`, else `message`."""
    if "messageExpression" in rule:
        message = evaluate(rule["messageExpression"], value)
        if not isinstance(message, str):
            raise RuleError(f"messageExpression {rule['messageExpression']!r} gave {message!r}, not a string")
        return str(message)
    return rule.get("message", f"failed rule: {rule['rule']}")


def cel_failures(schema: dict[str, Any], obj: Any, old: Any = None) -> list[str]:
    """Evaluate every CEL rule of `schema` on `obj` (already defaulted); the messages of the
    rules that fail, as the API server would report them. With `old` (the stored object, an
    update) transition rules run too, on the properties both have (lists are not correlated)."""
    failures = []

    def visit(node_schema: dict[str, Any], node: Any, before: Any = None) -> None:
        for rule in node_schema.get("x-kubernetes-validations") or []:
            message = rule_failure(rule, node, before)
            if message is not None:
                failures.append(message)
        if isinstance(node, dict):
            for key, sub in (node_schema.get("properties") or {}).items():
                if key in node:
                    visit(sub, node[key], before.get(key) if isinstance(before, dict) else None)
            if isinstance(node_schema.get("additionalProperties"), dict):
                for item in node.values():
                    visit(node_schema["additionalProperties"], item)
        if isinstance(node, list) and isinstance(node_schema.get("items"), dict):
            for item in node:
                visit(node_schema["items"], item)

    visit(schema, obj, old)
    return failures


# --- the checks ------------------------------------------------------------------------------


def problems_with_defaults(schema: dict[str, Any]) -> Iterator[str]:
    """Checks 1-3: rules compile and hold on their node's default, as written and defaulted."""
    for path, node in walk_nodes(schema):
        where = path or "<root>"
        default = node.get("default")
        if isinstance(default, dict) and default and apply_defaults(node, default) != default:
            yield (f"{where}: default {default} is incomplete; its nested defaults make it "
                   f"{apply_defaults(node, default)} (write that)")
        for rule in node.get("x-kubernetes-validations") or []:
            for key in ("rule", "messageExpression"):
                if key in rule:
                    try:
                        import celpy

                        celpy.Environment().compile(rule[key])
                    except Exception as err:
                        yield f"{where}: {key} {rule[key]!r} does not compile: {err}"
            if "default" not in node:
                continue
            for label, value in (("as written", default), ("defaulted", apply_defaults(node, default))):
                try:
                    failure = rule_failure(rule, value)
                    message_of(rule, value)  # must also evaluate where the rule holds
                except RuleError as err:
                    yield f"{where}: rule fails on the default ({label}): {err}"
                    continue
                if failure is not None:
                    yield f"{where}: the default ({label}) breaks its own rule: {failure}"


def problems_with_samples(schema: dict[str, Any], samples: list[Path]) -> Iterator[str]:
    """Check 4: every rule holds on every sample (defaulted)."""
    for sample in samples:
        for body in yaml.safe_load_all(sample.read_text()):
            if not body:
                continue
            try:
                failures = cel_failures(schema, apply_defaults(schema, body))
            except RuleError as err:
                yield f"{sample.name}: a rule fails to evaluate: {err}"
                continue
            for failure in failures:
                yield f"{sample.name}: refused by a rule: {failure}"


def _balanced(text: str, start: int) -> str:
    """The text inside the bracket opening at text[start], up to its matching close."""
    pairs = {"(": ")", "[": "]"}
    stack = [pairs[text[start]]]
    i = start + 1
    quote = None
    while i < len(text) and stack:
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in pairs:
            stack.append(pairs[ch])
        elif ch == stack[-1]:
            stack.pop()
        i += 1
    return text[start + 1:i - 1]


def measured_fields(expression: str) -> Iterator[tuple[str, str]]:
    """(field path relative to self, how it is used) for each field an expression turns into
    a string, formats, measures or iterates. Textual, which suffices for our rules."""
    for match in re.finditer(r"\b(string|size)\(", expression):
        for path in re.findall(_PATH, _balanced(expression, match.end() - 1)):
            yield path.lstrip("."), f"{match.group(1)}()"
    for match in re.finditer(r"\.format\(", expression):
        for path in re.findall(_PATH, _balanced(expression, match.end() - 1)):
            yield path.lstrip("."), "format()"
    for match in re.finditer(_PATH + r"\.(" + "|".join(ITERATING) + r"|size)\(", expression):
        yield match.group(1).lstrip("."), f".{match.group(2)}()"


def _resolve(node: dict[str, Any], path: str) -> dict[str, Any] | None:
    for key in filter(None, path.split(".")):
        props = node.get("properties") or {}
        if key in props:
            node = props[key]
        elif isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
        else:
            return None
    return node


def unbounded(node: dict[str, Any]) -> str | None:
    """What a schema node lacks for the API server to bound its size, or None."""
    kind = node.get("type")
    if "enum" in node or kind == "boolean":
        return None
    if kind in ("integer", "number"):
        return None if "maximum" in node else "maximum"
    if kind == "string":
        return None if "maxLength" in node else "maxLength"
    if kind == "array":
        return None if "maxItems" in node else "maxItems"
    if kind == "object" and "additionalProperties" in node:
        return None if "maxProperties" in node else "maxProperties"
    if node.get("x-kubernetes-int-or-string"):
        return "maxLength and maximum"
    return None


def problems_with_bounds(schema: dict[str, Any]) -> Iterator[str]:
    """Checks 5 and 6: bounded fields under string()/format()/size()/iteration; no '+' with string()."""
    for path, node in walk_nodes(schema):
        where = path or "<root>"
        for rule in node.get("x-kubernetes-validations") or []:
            for key in ("rule", "messageExpression"):
                expression = rule.get(key, "")
                for field, use in measured_fields(expression):
                    if f"{path}.{field}".lstrip(".") in SERVER_BOUNDED:
                        continue
                    target = _resolve(node, field)
                    if target is None:
                        yield f"{where}: {key} uses {field!r}, which the schema does not have"
                        continue
                    lacks = unbounded(target)
                    if lacks:
                        yield f"{where}.{field}: {key} {use} uses it, so it needs {lacks} (cost estimate)"
            message = rule.get("messageExpression", "")
            if re.search(r"\+\s*string\(|string\([^)]*\)\s*\+", message):
                yield (f"{where}: messageExpression joins string(...) with '+': the API server estimates "
                       f"its size as unbounded and refuses the cost; use '...%d...'.format([...])")


def check_crd(crd: dict[str, Any], samples: list[Path]) -> list[str]:
    """Every problem the checks find in one CRD, prefixed with its version."""
    problems = []
    for version, schema in crd_schemas(crd):
        for check in (problems_with_defaults(schema), problems_with_bounds(schema),
                      problems_with_samples(schema, samples)):
            problems += [f"{crd['metadata']['name']} {version}: {p}" for p in check]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("crds", nargs="*", type=Path, help="CRD files (default: crds/*.yaml)")
    parser.add_argument("--samples", type=Path, default=ROOT / "crds" / "samples",
                        help="folder of sample CRs every rule must accept (default: crds/samples)")
    args = parser.parse_args(argv)
    files = args.crds or sorted((ROOT / "crds").glob("*.yaml"))
    samples = sorted(args.samples.glob("*.yaml")) if args.samples.is_dir() else []
    problems = []
    for path in files:
        problems += [f"{path}: {p}" for p in check_crd(yaml.safe_load(path.read_text()), samples)]
    for problem in problems:
        print(problem)
    print(f"{len(problems)} problem(s) in {len(files)} CRD file(s), {len(samples)} sample(s)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
