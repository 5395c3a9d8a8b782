"""The ``cache`` command: where the verdict cache lives, what it holds, and how to empty it."""

from __future__ import annotations

import click


@click.group("cache", short_help="Show, prune or clear the verdict cache (facts of files already read).")
def cache_group() -> None:
    """The verdict cache: the facts and pickle verdicts of files a scan read, kept in the user's cache folder
    ($XDG_CACHE_HOME/ckptdoctor, else ~/.cache/ckptdoctor) so a rescan does not read unchanged files again.
    A file is taken from it only when its size, times and inode (its ETag or version on object storage) are those
    it had when read; rules always run. `scan --no-cache` and `gate --no-cache` leave it alone.

    A cache file no scan used for 30 days is removed by the first scan of the next day (`prune` does it now)."""


@cache_group.command("info")
def info_command() -> None:
    """Print the cache folder, whether it can be used, and how much it holds."""
    from ckptdoctor.cache.store import info

    found = info()
    click.echo(f"folder: {found.folder}")
    click.echo(f"state: {'in use' if found.problem is None else found.problem}")
    click.echo(f"files: {found.files} ({found.bytes:,} bytes)")


@cache_group.command("clear")
def clear_command() -> None:
    """Remove the cache's own files (and its folder, once empty); nothing else."""
    from ckptdoctor.cache.store import cache_dir, clear

    _say_removed(clear(), cache_dir())


@cache_group.command("prune")
@click.option(
    "--days", type=click.FloatRange(min=0), default=None, metavar="DAYS", show_default="30",
    help="Remove the files no scan used for this many days (0: every file but the key).",
)
def prune_command(days: float | None) -> None:
    """Remove the cache files no scan used for DAYS days (scans do this once a day with 30), and any temporary
    file a killed scan left."""
    from ckptdoctor.cache.store import KEEP_DAYS, cache_dir, prune

    _say_removed(prune(days=KEEP_DAYS if days is None else days), cache_dir())


def _say_removed(removed: int, folder: str) -> None:
    click.echo(f"removed {removed} file{'s' if removed != 1 else ''} from {folder}")
