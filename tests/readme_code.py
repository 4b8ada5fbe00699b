"""README.md's code blocks run as a user runs them: pasted at the end of model.py (here: run in a copy of
its namespace, the registries restored afterwards)."""

import contextlib
from pathlib import Path

import model as model_module

README = Path(__file__).parent.parent / "README.md"


def readme_blocks(section):
    """The python code blocks of README.md's section headed `## {section}`."""
    body = README.read_text().split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return [block.split("```", 1)[0] for block in body.split("```python\n")[1:]]


@contextlib.contextmanager
def pasted(code):
    """Runs code as if pasted at the end of model.py; yields the names it registered (RESIDUALS, then
    ATTENTIONS). The registries are put back on leaving."""
    registries = (model_module.RESIDUALS, model_module.ATTENTIONS)
    before = [dict(r) for r in registries]
    try:
        exec(code, dict(vars(model_module)))
        yield [name for r, b in zip(registries, before) for name in r if name not in b]
    finally:
        for r, b in zip(registries, before):
            r.clear()
            r.update(b)
