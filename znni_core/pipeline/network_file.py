"""The network file a run reads: a local path, or an object in storage (``s3://``, ``gs://``,
``http(s)://``) for jobs that share no file system with the machine the run was planned on.

``network.path`` may name a model in a bucket (``gs://lab-models/boundary.onnx``); every command
that loads the network (validate, each job, finalize) fetches it into the machine's znni cache
(``<cache>/networks/<digest of the URL>/``; a znni YAML spec with the weights file beside it, as
its ``weights:`` key names it) and loads that copy.  What identifies the network is its digest,
recorded by validate and compared by every job, never the path: a model replaced in the bucket
after validate is refused, as a local file is.

>>> network_file("/models/net.onnx")
PosixPath('/models/net.onnx')
"""

from __future__ import annotations

import hashlib
import posixpath
import re
from pathlib import Path

import yaml

from ..cachedir import cache_dir
from ..errors import NetworkError
from ..io.atomic import atomic_write
from ..io.paths import parse_layer_url
from ..io.store import object_store

_URL = re.compile(r"^(s3|gs|https?)://")


def is_remote_network(path: str) -> bool:
    """Whether ``path`` names a network in object storage or on a web server."""
    return bool(_URL.match(str(path)))


def network_file(path, endpoint: str | None = None) -> Path:
    """The local file of the network ``path`` (a path, or a URL fetched into the cache, see the
    module docstring); ``path`` may be a config's or a run's ``network`` section."""
    if hasattr(path, "path"):
        path, endpoint = path.path, getattr(path, "endpoint_url", None) or endpoint
    path = str(path)
    if not is_remote_network(path):
        return Path(path)

    dest = cache_dir() / "networks" / hashlib.sha256(f"{path} {endpoint}".encode()).hexdigest()[:16]
    name = posixpath.basename(path.rstrip("/"))
    data = _fetch(path, endpoint)
    atomic_write(dest / name, data)
    if name.lower().endswith((".yaml", ".yml")):
        weights = _weights_name(data, path)
        if weights:
            atomic_write(dest / weights, _fetch(posixpath.join(posixpath.dirname(path), weights), endpoint))
    return dest / name


def _fetch(url: str, endpoint: str | None) -> bytes:

    parent, name = posixpath.split(url.rstrip("/"))
    store = object_store(parse_layer_url(parent, endpoint=endpoint, what="network.path"), raw_names=True)
    data = store.get(name)
    if data is None:
        raise NetworkError(f"network file {url} does not exist" + (f" (endpoint {endpoint})" if endpoint else ""))
    return data


def _weights_name(spec: bytes, url: str) -> str | None:
    """The ``weights:`` file a YAML spec names beside itself; a path elsewhere is refused."""
    try:
        doc = yaml.safe_load(spec)
    except yaml.YAMLError as exc:
        raise NetworkError(f"{url} is not valid YAML: {exc}") from None
    weights = doc.get("weights") if isinstance(doc, dict) else None
    if weights is None:
        return None
    if not isinstance(weights, str) or "/" in weights or weights in ("", ".", ".."):
        raise NetworkError(
            f"{url}: weights {weights!r}: a spec fetched from storage names its weights file beside it "
            "(a bare file name, as in `weights: net.safetensors`)"
        )
    return weights
