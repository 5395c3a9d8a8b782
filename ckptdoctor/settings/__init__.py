"""Settings, in three rooms: ``files`` (settings files: find, read, the user configuration), ``selection`` (one
request's ``Options`` resolved per folder into a rule selection, and what a project file may not change), ``exit``
(the exit policy and ``Outcome``, the one answer to "did it fail"); ``codes`` checks rule codes for all three. What the
command line and the Python API share (no click)."""
