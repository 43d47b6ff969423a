"""Source fingerprints from source text: the one normalisation shared by the runtime check
(:func:`metapatch._framework.registry.fingerprint`, which reads ``inspect.getsource``) and the static reader
of ``metapatch survey`` (which reads a wheel's file without installing it).

The hash ignores formatting, comments and docstrings, so upstream reformatting does not make a
patch stale but any change to the logic does. It is also the same on every Python in the support
window: the dump is taken in the shape Python 3.9-3.11 give it (3.12 added an always-present
``type_params`` field, 3.13 stopped printing empty fields), so a fingerprint measured on one
interpreter holds on the others.
"""

from __future__ import annotations

import sys

# Fields that newer Pythons added to existing nodes; dropped when empty, which is all that
# code valid on Python 3.9 can produce.
_NEWER_FIELDS = ("type_params",)


def fingerprint_source(source: str) -> str:
    """A short hash of one definition's source (a ``def`` or ``class`` with its decorators, as
    ``inspect.getsource`` returns it; indentation is removed first)."""
    import ast
    import hashlib
    import textwrap

    tree = ast.parse(textwrap.dedent(source))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
        for name in _NEWER_FIELDS:
            if name in getattr(node, "_fields", ()) and not getattr(node, name, None):
                try:
                    delattr(node, name)  # a missing field is skipped by ast.dump, as on 3.11
                except AttributeError:
                    pass
    options = {"show_empty": True} if sys.version_info >= (3, 13) else {}
    canonical = ast.dump(tree, annotate_fields=False, include_attributes=False, **options)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]
