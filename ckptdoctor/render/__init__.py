"""Renderings for people and tools, no click: ``report`` (the scan report as text and ``ckptdoctor.report/1`` JSON),
``sarif`` (SARIF 2.1.0 and GitHub annotations), ``inspect`` (``ckptdoctor inspect``'s text) and ``fix`` (the fix
plan and undo as text and JSON)."""
