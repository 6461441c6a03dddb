"""Where a Delta destination keeps its tables: a local folder, or ``s3a://bucket/prefix``.

Both sides reach the same place through one description: delta-rs (the driver's commits, reads,
maintenance) takes a table URI and ``storage_options``; the tasks write their Parquet files, and
the driver keeps its small ledger objects, through a ``pyarrow.fs`` file system. For S3, the
credentials, region and endpoint come from the environment as the AWS tools read them
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``,
``AWS_ENDPOINT_URL`` for an S3-compatible server), and ``options.storage_options`` adds
delta-rs settings; Spark reads the same tables through ``hadoop-aws`` (docs/delta.md).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    import pyarrow.fs as pafs

S3_SCHEMES = ("s3a", "s3", "s3n")
OWN = "_headwater"  # the destination's own objects beside the tables: ledger, offsets, staging
PRIMARY_KEY = "headwater.primaryKey"  # a table property: the key upserts merge on
WRITER, BATCH = "headwater.writer", "headwater.batch"  # commit info of a batch's transaction
_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL")


def region() -> str:
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"


@dataclass(frozen=True)
class Location:
    """The destination's root: ``root`` is a local folder or ``bucket/prefix`` on S3."""

    root: str
    s3: bool = False
    extra: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, path: str, extra: Mapping[str, str] | None = None) -> Location:
        scheme, sep, rest = path.partition(":/")
        if sep and scheme in S3_SCHEMES:  # the config's path went through pathlib: s3a:/b/p
            path = f"{scheme}://{rest.lstrip('/')}"
        parts = urlsplit(path)
        if parts.scheme in S3_SCHEMES:
            if not parts.netloc:
                raise ValueError(f"{path!r} names no bucket (s3a://bucket/prefix)")
            return cls(f"{parts.netloc}/{parts.path.strip('/')}".rstrip("/"), True, extra or {})
        if parts.scheme and len(parts.scheme) > 1:  # not a Windows drive letter
            raise ValueError(f"{path!r}: a delta path is a local folder or s3a://bucket/prefix")
        return cls(str(Path(path).absolute()), False, extra or {})

    def path(self, *names: str) -> str:
        """A file-system path below the root (for ``filesystem()``)."""
        return "/".join((self.root, *names))

    def uri(self, table: str) -> str:
        """The table's URI for delta-rs."""
        return f"s3://{self.path(table)}" if self.s3 else self.path(table)

    def storage_options(self) -> dict[str, str]:
        """delta-rs's object-store settings: the environment's, then ``options``."""
        if not self.s3:
            return dict(self.extra)
        out = {k: os.environ[k] for k in _ENV if os.environ.get(k)}
        out["AWS_REGION"] = region()
        endpoint = out.get("AWS_ENDPOINT_URL", "")
        if endpoint.startswith("http://"):
            out["AWS_ALLOW_HTTP"] = "true"
        out.update(self.extra)
        return out

    def filesystem(self) -> pafs.FileSystem:
        return _filesystem(self.s3, tuple(sorted(self.storage_options().items())))

    # -- small objects and listings ---------------------------------------------------------
    def read_text(self, *names: str) -> str | None:
        import pyarrow as pa

        fs = self.filesystem()
        try:
            with fs.open_input_stream(self.path(*names)) as f:
                return bytes(f.read()).decode()
        except (FileNotFoundError, pa.ArrowIOError):
            if _missing(fs, self.path(*names)):
                return None
            raise

    def write_text(self, text: str, *names: str) -> None:
        """Replace the object atomically (S3: one PUT; local: a durable rename)."""
        fs = self.filesystem()
        final = self.path(*names)
        if self.s3:
            with fs.open_output_stream(final) as f:
                f.write(text.encode())
            return
        from headwater.destinations.batches import replace_file

        replace_file(Path(final), text.encode())

    def files(self, *names: str, prefix: str = "") -> Iterator[str]:
        """Paths of the files below ``names`` (recursively) whose name starts with ``prefix``."""
        import pyarrow.fs as pafs

        fs = self.filesystem()
        selector = pafs.FileSelector(self.path(*names), allow_not_found=True, recursive=True)
        for info in fs.get_file_info(selector):
            if info.type == pafs.FileType.File and info.base_name.startswith(prefix):
                yield info.path

    def folders(self, *names: str) -> list[str]:
        """The names of the folders right below ``names``."""
        import pyarrow.fs as pafs

        selector = pafs.FileSelector(self.path(*names), allow_not_found=True)
        infos = self.filesystem().get_file_info(selector)
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)

    def delete(self, paths: list[str]) -> None:
        fs = self.filesystem()
        for p in paths:
            with contextlib.suppress(FileNotFoundError):
                fs.delete_file(p)

    def remove_tree(self, *names: str) -> None:
        fs = self.filesystem()
        with contextlib.suppress(FileNotFoundError):
            fs.delete_dir(self.path(*names))

    def exists(self, paths: list[str]) -> list[bool]:
        import pyarrow.fs as pafs

        return [i.type == pafs.FileType.File for i in self.filesystem().get_file_info(paths)]


def _missing(fs: pafs.FileSystem, path: str) -> bool:
    import pyarrow.fs as pafs

    return bool(fs.get_file_info(path).type == pafs.FileType.NotFound)


@functools.cache
def _filesystem(s3: bool, options: tuple[tuple[str, str], ...]) -> pafs.FileSystem:
    """One file system per process and settings (an S3 client keeps its connections)."""
    import pyarrow.fs as pafs

    if not s3:
        return pafs.LocalFileSystem()
    o = dict(options)
    endpoint = o.get("AWS_ENDPOINT_URL", "")
    parts = urlsplit(endpoint) if endpoint else None
    return pafs.S3FileSystem(
        access_key=o.get("AWS_ACCESS_KEY_ID"),
        secret_key=o.get("AWS_SECRET_ACCESS_KEY"),
        session_token=o.get("AWS_SESSION_TOKEN"),
        region=o.get("AWS_REGION", region()),
        endpoint_override=parts.netloc if parts else None,
        scheme=parts.scheme if parts else "https",
        allow_bucket_creation=False,
    )
