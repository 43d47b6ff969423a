"""metapatch's start-up hook for ``metapatch run`` (this folder is first on PYTHONPATH).

Imports metapatch, then runs the ``sitecustomize`` that Python would have run without this one (the
next one on ``sys.path``), so a site's or user's own start-up code still runs. Nothing here may
raise: a broken or missing metapatch must never stop the program from starting.
"""


def _metapatch_start() -> None:
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    if os.environ.get("METAPATCH_AUTOLOAD", "1") != "0":
        _import_metapatch(os, sys)
    _chain_next_sitecustomize(os, sys, here)


def _import_metapatch(os, sys) -> None:
    # `metapatch run` from a source checkout: the package is not on every child's sys.path (other
    # working directories), so the launcher names its folder. It goes last and only for this import;
    # the package's own __path__ serves its submodules afterwards.
    home = os.environ.get("METAPATCH_BOOTSTRAP_HOME", "")
    added = bool(home) and home not in sys.path
    if added:
        sys.path.append(home)
    try:
        import metapatch  # noqa: F401
    except Exception as exc:
        if not (isinstance(exc, ImportError) and exc.name == "metapatch"):
            sys.stderr.write(f"metapatch: not active in this process ({type(exc).__name__}: {exc})\n")
    finally:
        if added and home in sys.path:
            sys.path.remove(home)


def _chain_next_sitecustomize(os, sys, here) -> None:
    try:
        import importlib.util

        later = []
        seen_self = False
        for entry in sys.path:
            ours = os.path.abspath(entry or os.getcwd()) == here
            seen_self = seen_self or ours
            if seen_self and not ours:  # never this folder again: that would run us twice
                later.append(entry)
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec("sitecustomize", later)
        if spec is None or spec.loader is None:
            return
        module = importlib.util.module_from_spec(spec)
        ours = sys.modules.get("sitecustomize")
        # Theirs is *the* sitecustomize from now on, as it would have been without us.
        sys.modules["sitecustomize"] = module
        try:
            spec.loader.exec_module(module)
        except Exception:
            # What site.py does with a failing sitecustomize: report it, start anyway.
            import traceback

            sys.stderr.write(f"Error in sitecustomize ({spec.origin}); set PYTHONVERBOSE for traceback:\n")
            sys.stderr.write("".join(traceback.format_exception_only(*sys.exc_info()[:2])))
            if ours is not None:
                sys.modules["sitecustomize"] = ours
    except Exception:
        pass


try:
    _metapatch_start()
except Exception:
    pass
