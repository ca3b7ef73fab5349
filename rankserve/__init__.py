"""rankserve: serve low-rank (SVD-compressed) LLaMA models fast."""

import os as _os
import sys as _sys

__version__ = "0.1.0"

# The subpackages live in top-level folders (kernels/, workers/, ...) mapped by pyproject's package-dir.
# An editable install by an older setuptools, or running from a bare checkout, maps only this folder:
# then find rankserve.<pkg> in the checkout's root as well (a wheel install has no such sibling folders).
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "workers", "__init__.py")) and _root not in __path__:
    __path__.append(_root)

# The root's folders are rankserve.* and nothing else, found through __path__ above. With the root itself on sys.path
# (`python -m ...` run from the checkout, or processes Ray starts there) kernels/ would shadow the PyPI package
# `kernels`, which transformers >= 5.25 imports (and so sentence-transformers, MiniLM's embedder): take it off.
_cwd = _os.getcwd()
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _cwd) != _root]
