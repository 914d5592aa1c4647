"""A read-only zarr-python store over a znni :class:`~.store.ObjectStore`.

zarr-python reads a remote array through a store of its own (fsspec, obstore), each with its own
retries, timeouts and credential lookup.  A zarr input on ``s3://``, ``gs://`` or ``http(s)://``
is read through this adapter instead, so every request goes through znni's bounded clients
(:mod:`.s3`, :mod:`.gcs`, :mod:`.http`): the same retries, the same errors naming the object,
the same signing rule (:mod:`.auth`) as a precomputed input.  The blocking requests run in
threads (``asyncio.to_thread``), so zarr's concurrent chunk reads stay concurrent.

Keys are relative to the array (or group) the store is rooted at; listing is not supported (znni
never lists: it names the keys it reads).
"""

from __future__ import annotations

import asyncio

from zarr.abc.store import OffsetByteRequest, RangeByteRequest, Store, SuffixByteRequest
from zarr.core.buffer import default_buffer_prototype

from ..errors import ConfigError
from .store import ObjectStore


class ObjectZarrStore(Store):
    """zarr's :class:`~zarr.abc.store.Store` interface, read-only, over ``objects``."""

    supports_writes = False
    supports_deletes = False
    supports_partial_writes = False
    supports_listing = False

    def __init__(self, objects: ObjectStore):
        super().__init__(read_only=True)
        self.objects = objects

    def __eq__(self, other) -> bool:
        return isinstance(other, ObjectZarrStore) and str(other.objects.url) == str(self.objects.url)

    def __hash__(self) -> int:
        return hash(str(self.objects.url))

    def __str__(self) -> str:
        return str(self.objects.url)

    def with_read_only(self, read_only: bool = False):
        """This store (it is read-only whatever is asked; a write fails at the write)."""
        return self

    def _get(self, key: str, byte_range) -> bytes | None:
        o = self.objects
        if byte_range is None:
            return o.get(key)
        if isinstance(byte_range, RangeByteRequest):
            return o.get_range(key, byte_range.start, byte_range.end)
        size = o.sizes([key])[key]
        if size is None:
            return None
        if isinstance(byte_range, OffsetByteRequest):
            start = min(byte_range.offset, size)
        elif isinstance(byte_range, SuffixByteRequest):
            start = max(size - byte_range.suffix, 0)
        else:
            raise TypeError(f"unexpected byte range {byte_range!r}")
        return o.get_range(key, start, size)

    async def get(self, key: str, prototype=None, byte_range=None):
        """The object's bytes (or a range of them) as a zarr buffer, or None if absent."""
        data = await asyncio.to_thread(self._get, key, byte_range)
        if data is None:
            return None
        return (prototype or default_buffer_prototype()).buffer.from_bytes(data)

    async def get_partial_values(self, prototype, key_ranges):
        """:meth:`get` of each ``(key, range)``, together."""
        return await asyncio.gather(*(self.get(k, prototype, r) for k, r in key_ranges))

    async def exists(self, key: str) -> bool:
        """Whether ``key`` is stored (one HEAD)."""
        return await asyncio.to_thread(self.objects.exists, key)

    async def set(self, key, value, byte_range=None) -> None:
        """Refused: znni reads its inputs, never writes them."""
        raise ConfigError(f"{self.objects.where(key)}: a zarr input is read-only")

    async def delete(self, key) -> None:
        """Refused: znni reads its inputs, never writes them."""
        raise ConfigError(f"{self.objects.where(key)}: a zarr input is read-only")

    async def list(self):
        """Not supported (znni never lists a store)."""
        raise NotImplementedError("listing a remote zarr input is not supported")
        yield  # pragma: no cover  (an async generator)

    async def list_prefix(self, prefix: str):
        """Not supported (znni never lists a store)."""
        raise NotImplementedError("listing a remote zarr input is not supported")
        yield  # pragma: no cover

    async def list_dir(self, prefix: str):
        """Not supported (znni never lists a store)."""
        raise NotImplementedError("listing a remote zarr input is not supported")
        yield  # pragma: no cover
