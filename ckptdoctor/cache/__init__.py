"""The verdict cache: each file's facts and pickle verdict kept in the user's cache folder, so that a rescan reads
only the files that changed (``source.FactsCache``), stored in a format that decodes without running anything
(``codec``), in files only this user's ckptdoctor can have written (``store``)."""

from __future__ import annotations

__all__ = ["CodecError"]


class CodecError(ValueError):
    """A value the encoding does not hold, or a document that is not one it wrote (``codec``). Defined here, so the
    cache can catch it without importing the codec, which a first scan (sightings only) never needs."""
