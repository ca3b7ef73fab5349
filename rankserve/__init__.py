"""rankserve: serve low-rank (SVD-compressed) LLaMA models fast."""

import os as _os

__version__ = "0.1.0"

# The subpackages live in top-level folders (kernels/, workers/, ...) mapped by pyproject's package-dir.
# An editable install by an older setuptools, or running from a bare checkout, maps only this folder:
# then find rankserve.<pkg> in the checkout's root as well (a wheel install has no such sibling folders).
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "workers", "__init__.py")) and _root not in __path__:
    __path__.append(_root)
