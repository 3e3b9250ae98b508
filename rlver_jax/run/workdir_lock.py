"""One run per workdir: a second run started on a busy workdir is refused, naming the first.

The lock is an flock on WORKDIR/.run.lock held for the process's lifetime: the kernel releases it
when the process dies however it dies (a kill -9 leaves nothing stuck), and the file, which stays,
records the holder's pid and host for the refusal line. Only process 0 takes it: the hosts of one
run share the workdir.

A gs:// workdir is not locked: GCS has no lock that the death of its holder releases, and a lease
with an expiry would keep a preempted run's restart (the common case there) out until it lapsed.
"""
from __future__ import annotations

import errno
import fcntl
import os
import socket

from absl import logging

LOCK_FILE = ".run.lock"
# Filesystems without locks (some FUSE and NFS mounts) answer with these.
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


class WorkdirLock:
  """Holds WORKDIR/.run.lock until `release` or the process's end; `None` from `lock_workdir` when
  the workdir cannot be locked (said in one warning line)."""

  def __init__(self, fd: int):
    self._fd = fd

  def release(self) -> None:
    if self._fd is not None:
      os.close(self._fd)  # closing the file releases the flock
      self._fd = None


def lock_workdir(workdir: str) -> WorkdirLock | None:
  if "://" in workdir:
    logging.warning("--workdir=%s: not locked (GCS has no lock that a killed run releases): start "
                    "one run on it at a time", workdir)
    return None
  path = os.path.join(workdir, LOCK_FILE)
  try:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
  except OSError as e:
    raise ValueError(f"--workdir={workdir}: cannot open {LOCK_FILE} ({e.strerror})") from None
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as e:
    holder = _read(fd)
    os.close(fd)
    if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
      holder = holder or "pid and host not written yet"
      raise ValueError(f"--workdir={workdir}: in use by another run ({holder}); wait for it to end or "
                       "use another --workdir") from None
    if e.errno in _NO_LOCKS:
      logging.warning("--workdir=%s: not locked (%s): start one run on it at a time", workdir,
                      e.strerror)
      return None
    raise ValueError(f"--workdir={workdir}: cannot lock {LOCK_FILE} ({e.strerror})") from None
  os.ftruncate(fd, 0)
  os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
  return WorkdirLock(fd)


def _read(fd: int) -> str:
  return os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
