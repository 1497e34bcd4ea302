"""Writes megatron_flags.json: the flags of Megatron-LM's argument parser (facts only: spellings,
destination, action, nargs, type name, choices, default, group), read by building the parser of a
Megatron-LM checkout.

    python tests/training/extract_megatron_flags.py /path/to/Megatron-LM > tests/training/megatron_flags.json

The checkout needs torch importable (no GPU); its git commit is recorded. Not a test: pytest
collects test_*.py only.
"""

import argparse
import enum
import json
import subprocess
import sys
import typing


def _jsonable(value):
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return None  # a default that is an object (a dtype, a function): not a fact the tests use


def _action_kind(action) -> str:
    return type(action).__name__.lstrip("_").replace("Action", "").lower()


def megatron_flags(checkout: str) -> dict:
    sys.path.insert(0, checkout)
    typing.override = getattr(typing, "override", lambda f: f)  # Python < 3.12
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    group_of = {id(a): g.title for g in parser._action_groups for a in g._group_actions}
    flags = []
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        flags.append(dict(
            flags=action.option_strings, dest=action.dest, action=_action_kind(action), nargs=action.nargs,
            type=None if action.type is None else getattr(action.type, "__name__", type(action.type).__name__),
            choices=None if action.choices is None else [_jsonable(c) for c in action.choices],
            default=_jsonable(action.default), group=group_of.get(id(action))))
    commit = subprocess.run(["git", "-C", checkout, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    return {"megatron_lm_commit": commit.strip() or None,
            "source": "megatron/training/arguments.py: add_megatron_arguments(argparse.ArgumentParser())",
            "flags": flags}


def dumps(data: dict) -> str:
    """JSON with one flag per line."""
    head = {k: v for k, v in data.items() if k != "flags"}
    lines = [f"  {json.dumps(f)}" for f in data["flags"]]
    return json.dumps(head, indent=1)[:-2] + ',\n "flags": [\n' + ",\n".join(lines) + "\n ]\n}\n"


if __name__ == "__main__":
    sys.stdout.write(dumps(megatron_flags(sys.argv[1])))
