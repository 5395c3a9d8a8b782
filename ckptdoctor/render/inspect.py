"""``ckptdoctor inspect``'s text: a file's description (``inspection.inspect_file``) as a header, a tensor table or
the pickle's globals and values, then the problems."""

from __future__ import annotations

import json
from typing import Any

_MARKS = {"dangerous": " [dangerous: CKD601]", "denied": " [not proved harmless as used: CKD601]",
          "unknown": " [not allowlisted: CKD602]", "allowed": ""}


def _marked(names: list[str], verdicts: dict[str, str]) -> str:
    return ", ".join(n + _MARKS.get(verdicts.get(n, ""), "") for n in names) or "none"


def _only_tensors(value: Any) -> bool:
    """A plain state dict (every value a tensor) is already shown by the tensor table."""
    if not isinstance(value, dict) or not value:
        return False
    return all(isinstance(v, dict) and "tensor" in v for v in value.values())


def render_inspect_text(data: dict[str, Any], width: int | None = None) -> str:
    """The description as a short header, a tensor table or the pickle's globals and values, then problems (each
    wrapped to a terminal's ``width``; None keeps it on one line)."""
    from tabulate import tabulate  # only the text needs it

    from ckptdoctor.render.report import fit

    lines = [f"{data['path']}: {data['kind']}, {data['bytes']:,} bytes"]
    tensors = data.get("tensors")
    if tensors:
        rows = [[t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar", t["bytes"]] for t in tensors]
        lines.append(tabulate(rows, headers=["tensor", "dtype", "shape", "bytes"], tablefmt="simple"))
    elif tensors is not None:
        lines.append("no tensors")
    if "globals" in data:
        verdicts = data.get("verdicts", {})
        lines.append("globals imported: " + _marked(data["globals"], verdicts))
        lines.append("globals called:   " + _marked(data["calls"], verdicts))
    for key in ("metadata", "keys", "value", "text"):
        if key in data and data[key] is not None and not (key == "value" and _only_tensors(data[key])):
            lines.append(f"{key}:")
            lines.append(json.dumps(data[key], indent=2, default=str)[:20000])
    if data["problems"]:
        lines.append("problems:")
        lines.extend(w for p in data["problems"] for w in fit(f"  [{p['kind']}] {p['message']}", width))
    return "\n".join(lines)
