"""Judging pickles, the room between the readers (which walk a stream opcode by opcode, ``readers/pickle_walk.py``)
and the rules (which report): ``policy`` says what each global is (allowed, unproven, unknown, unsafe) and which calls
are reviewed harmless, from the generated ``allowlist.json`` and the installed packages' source read with ``ast``;
``judge`` applies it to a walk's facts, the nested pickles and base64 blobs in its values included, and gives each
file its ``Verdict``. Nothing here imports torch or runs an opcode."""
