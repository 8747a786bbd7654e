"""Ray token authentication for a local `kvmesh serve`.

Binding to 127.0.0.1 keeps other machines out, not other users of this one: Ray's GCS, raylet
and each Serve replica's internal gRPC server (which unpickles what it receives) answer anyone
who can reach the port. Ray 2.60's token auth checks a shared token on all of them (the replica
server attaches Ray's auth interceptor when RAY_AUTH_MODE=token). So a local `kvmesh serve`
turns it on unless the user chose a mode (RAY_AUTH_MODE set, e.g. `disabled`).

The token is Ray's own: RAY_AUTH_TOKEN or the file RAY_AUTH_TOKEN_PATH when set, else
~/.ray/auth_token, which Ray's CLI, `ray.init(address=...)` and `kvmesh serve --address` read
too. When that file is missing it is created here, readable by its owner only (Ray would create
it with the process's umask, usually readable by every local user).
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

MODE_ENV = "RAY_AUTH_MODE"


def default_token_path() -> Path:
    return Path.home() / ".ray" / "auth_token"


def enable_token_auth(environ=os.environ) -> str | None:
    """Turn Ray token auth on for the Ray this process starts; returns a warning to print, if any."""
    if MODE_ENV in environ:
        return None
    environ[MODE_ENV] = "token"
    if environ.get("RAY_AUTH_TOKEN") or environ.get("RAY_AUTH_TOKEN_PATH"):
        return None
    path = default_token_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            return (f"kvmesh serve: {path} (the Ray auth token) is readable by other users; "
                    f"chmod 600 {path}")
        return None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return None
