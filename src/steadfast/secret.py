"""The job's secret: what binds the records that steer a job (tickets, verdicts, loss
claims, fences, culprits, the exit barrier) to the job's own nodes
(:mod:`steadfast.rendezvous.signed`).

``steadfast slurm`` makes one per job (:func:`make_secret_file`: 32 random bytes, hex, in
a 0600 file in the job's folder) and exports its path to the batch script. ``steadfast
launch`` reads it from ``$STEADFAST_JOB_SECRET_FILE`` or ``$STEADFAST_JOB_SECRET`` (the
value itself), never from its command line, where ``ps`` shows it to every user of the
node. A file that others can read is refused: a secret everyone has binds nothing.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

__all__ = ["SECRET_ENV", "SECRET_FILE_ENV", "SecretError", "load_secret", "make_secret_file"]

#: The secret itself (at least 16 characters), for jobs that pass it in the environment.
SECRET_ENV = "STEADFAST_JOB_SECRET"
#: A file holding it (0600), as ``steadfast slurm`` writes it.
SECRET_FILE_ENV = "STEADFAST_JOB_SECRET_FILE"
#: The least length of a secret (characters): a short one is guessed.
MIN_LENGTH = 16


class SecretError(ValueError):
    """A secret that cannot be used: said once, naming the variable or the file."""


def load_secret(environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The job's secret, or None when the job has none."""
    path = environ.get(SECRET_FILE_ENV, "").strip()
    inline = environ.get(SECRET_ENV, "")
    if path and inline:
        raise SecretError(f"${SECRET_ENV} and ${SECRET_FILE_ENV} are both set: choose one")
    if path:
        try:
            info = os.stat(path)
            if stat.S_IMODE(info.st_mode) & 0o077:
                raise SecretError(
                    f"${SECRET_FILE_ENV}={path}: others may read it (mode "
                    f"{stat.S_IMODE(info.st_mode):04o}); chmod 600 it"
                )
            value = Path(path).read_text().strip()
        except OSError as exc:
            raise SecretError(f"${SECRET_FILE_ENV}={path}: {exc.strerror or exc}") from None
        where = f"${SECRET_FILE_ENV}={path}"
    elif inline:
        value, where = inline.strip(), f"${SECRET_ENV}"
    else:
        return None
    if len(value) < MIN_LENGTH:
        raise SecretError(
            f"{where}: the secret is {len(value)} characters; at least {MIN_LENGTH} "
            "(steadfast slurm makes one of 64)"
        )
    return value.encode()


def make_secret_file(path: Path) -> Path:
    """A new secret in ``path`` (created 0600, never readable by others, not even for
    a moment), replacing none: an existing file is an error, not overwritten."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path
