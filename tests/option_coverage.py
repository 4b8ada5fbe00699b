"""Helpers for the option-coverage tests (tests/test_options_*.py): each holds a table, option -> the
test(s) that check what the option changes, and asserts that the table names every option its entry
points have (walked from their argparse parsers, config keys and signatures) and only tests that exist."""

import argparse
import ast
import contextlib
import inspect
import pathlib

TESTS = pathlib.Path(__file__).parent


class _Parser(Exception):
    def __init__(self, parser):
        self.parser = parser


def parser_of(main, *args):
    """The argparse parser that `main(*args)` builds, caught when it first parses (nothing else runs)."""

    def catch(parser, *_, **__):
        raise _Parser(parser)

    original = argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_known_args = catch
    try:
        main(*args)
    except _Parser as caught:
        return caught.parser
    finally:
        argparse.ArgumentParser.parse_known_args = original
    raise AssertionError(f"{main.__module__}.{main.__name__} parsed no arguments")


def flags(parser):
    """Every option string of parser (long form where it has one), and its positionals by dest."""
    out = set()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        longs = [s for s in action.option_strings if s.startswith("--")]
        out.add(longs[0] if longs else action.option_strings[0] if action.option_strings else action.dest)
    return out


def parameters(fn, skip=("self",)):
    return {n for n in inspect.signature(fn).parameters if n not in skip}


_test_names = {}


def missing(table, options):
    """Problems of a coverage table against the options it must cover: options not in it, entries that are
    no option, and tests named that do not exist ("test_file.py::test_name")."""
    problems = [f"{o}: no test in the table" for o in sorted(options - set(table))]
    problems += [f"{o}: in the table but not an option" for o in sorted(set(table) - options)]
    for option, refs in table.items():
        for ref in [refs] if isinstance(refs, str) else refs:
            file, _, name = ref.partition("::")
            if file not in _test_names:
                with contextlib.suppress(FileNotFoundError):
                    tree = ast.parse((TESTS / file).read_text())
                    _test_names[file] = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
            if name not in _test_names.get(file, ()):
                problems.append(f"{option}: {ref} does not exist")
    return problems
