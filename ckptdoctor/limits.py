"""Resource limits for every reader, in one place.

Going over a limit is a read problem (a finding), never a hang, a crash or an unbounded allocation.
"""

from __future__ import annotations

from ckptdoctor.model import frozen


@frozen
class Limits:
    """Caps that bound the work and memory a scan may spend on one input."""

    # safetensors' own MAX_HEADER_SIZE (safetensors/src/tensor.rs): larger headers are rejected by the library.
    safetensors_header_bytes: int = 100_000_000
    # JSON files (trainer_state.json with a long log_history can reach tens of MB).
    json_bytes: int = 256_000_000
    # A pickle stream (data.pkl, .metadata, raw pickles). Real optimizer.pt pickles of 70B models are a few MB.
    pickle_bytes: int = 512_000_000
    pickle_opcodes: int = 20_000_000
    pickle_memo_entries: int = 5_000_000
    # Distinct globals of one file (its nested pickles included) judged by reading the installed package's source
    # (``pickle_verdict.policy.FileStandings``): each is a sys.path search and may be a parse of megabytes. Real
    # files name a few dozen globals, nearly all on the allowlist; past this, the rest are unproven, so unsafe
    # (CKD601).
    pickle_source_globals: int = 256
    # Depth of nested containers / stack while walking a pickle or JSON value.
    nesting_depth: int = 500
    # Entries in one zip central directory.
    zip_entries: int = 1_000_000
    # Cross-check the local header of every tensor storage record (`<archive>/data/<key>`) of a torch zip against
    # the central directory. Off by default: torch reads those records only as raw bytes, every record a loader
    # parses stays checked, and each check is one scattered read per tensor (on a cold disk a 4 KB block each:
    # 879 per 7B AdamW optimizer.pt; on object storage a request each), which would make a scan's cost grow with
    # the tensor count. `--deep` turns it on: it reads those records anyway.
    zip_data_local_headers: bool = False
    # Bytes of one `.distcp` file searched for the torch.save blobs inside it (DCP loads their pickles with
    # weights_only=False, so every one is walked); a larger file is analysed up to here and reported.
    dcp_data_bytes: int = 64_000_000_000
    # Objects (groups and datasets) of one HDF5 file listed through h5py, and chunks of one chunked dataset checked
    # against the file's end; a Keras weights file holds a few hundred objects and no chunked datasets.
    hdf5_objects: int = 100_000
    hdf5_chunks: int = 1_000_000
    # Tar archives and gzip/bz2/xz streams (``readers/archive.py``): members listed, archives nested in archives,
    # bytes decompressed in all (past it the rest is unchecked, so the archive is reported: a decompression bomb is
    # a finding, never a hang), and the bytes of one PAX extended header or GNU long name (tarfile reads them whole).
    archive_members: int = 100_000
    archive_depth: int = 4
    archive_decompressed_bytes: int = 2_000_000_000
    archive_header_bytes: int = 1_000_000
    # Text files we read whole (`latest`).
    text_bytes: int = 4096
    # Directory walk: depth and number of entries before discovery stops and reports.
    dir_depth: int = 64
    dir_entries: int = 2_000_000


DEFAULT_LIMITS = Limits()
