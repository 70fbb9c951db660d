"""Object storage and local folders through pyarrow.fs: locations named by URI (credentials from
the environment only), caller-chosen keys that cannot leave their prefix, and files written whole
or not at all. Pure: no Serve, no protocol, no engine; the serving layer (request sinks) and
batch-decode (inputs and outputs) use it."""

from vae_service.storage.keys import InvalidKey, check_key, object_names, temporary_of
from vae_service.storage.locations import (
    KeyThroughLink,
    Location,
    LocationError,
    NameTakenByFolder,
    RefusedByStore,
    StoredObject,
    StoreUnavailable,
    check_location,
    open_location,
    parse_uri,
    redact,
    scrub,
)

__all__ = [
    "InvalidKey",
    "KeyThroughLink",
    "Location",
    "LocationError",
    "NameTakenByFolder",
    "RefusedByStore",
    "StoreUnavailable",
    "StoredObject",
    "check_key",
    "check_location",
    "object_names",
    "open_location",
    "parse_uri",
    "redact",
    "scrub",
    "temporary_of",
]
