"""ckptdoctor's version: the one value every layer may name (reports, journals, manifests), kept apart from the
package face (``ckptdoctor/__init__.py``, the API) so that nothing below the API imports the root package."""

from __future__ import annotations

__version__ = "0.1.0"
