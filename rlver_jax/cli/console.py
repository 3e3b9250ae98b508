"""A quiet console for the command-line entry points.

Libraries log through absl at INFO (orbax prints dozens of lines per checkpoint, jax its backend
probing). Unless the user sets --verbosity (or -v) themselves, only this package's own INFO lines
and everyone's warnings and errors reach the terminal. On a machine without a TPU, jax is kept from
starting libtpu (`skip_absent_tpu`), whose failed start would print half a dozen lines.
"""
from __future__ import annotations

import glob
import importlib.util
import logging
import os
import pathlib
import pkgutil
import sys

from absl import flags
from absl import logging as absl_logging

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class OwnInfoOnly(logging.Filter):
  """Passes warnings and errors from anywhere, lower levels only from this package."""

  def filter(self, record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or os.path.abspath(record.pathname).startswith(_PACKAGE)


_FILTER = OwnInfoOnly()


def quiet_library_logs() -> bool:
  """Hides library INFO logs unless --verbosity was given; call after flag parsing. Returns whether
  it did."""
  if flags.FLAGS["verbosity"].present:
    return False
  handler = absl_logging.get_absl_handler()
  if _FILTER not in handler.filters:
    handler.addFilter(_FILTER)
  return True


# Set by a user or launcher who means a TPU (or a forced libtpu start): jax is left to its defaults.
# Not TPU_LIBRARY_PATH: importing libtpu sets it.
_TPU_ENV = ("JAX_FORCE_TPU_INIT", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES")
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_DEVICES = {"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"}  # v3..7x
_GPU_PLUGINS = {"xla_cuda": ("cuda", ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg")),
                "xla_rocm": ("rocm", ("/dev/kfd",))}


def _tpu_visible() -> bool:
  """A TPU chip on this machine: its device files (v2-v4: /dev/accel*; v5 and later: VFIO groups)
  or a TPU on the PCI bus. Unknown VFIO groups count too: better some noise than a missed TPU."""
  if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
    return True
  for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
    device = pathlib.Path(vendor).with_name("device")
    try:
      if (pathlib.Path(vendor).read_text().strip() == _GOOGLE_PCI_VENDOR
          and device.read_text().strip() in _TPU_PCI_DEVICES):
        return True
    except OSError:
      continue
  return False


def _gpu_platforms() -> list[str]:
  """The GPU platforms whose jax plugin is installed and whose devices are present."""
  plugins = importlib.util.find_spec("jax_plugins")  # a namespace package: found, not imported
  if plugins is None or not plugins.submodule_search_locations:
    return []
  names = [m.name for m in pkgutil.iter_modules(plugins.submodule_search_locations)]
  return [platform for prefix, (platform, files) in _GPU_PLUGINS.items()
          if any(n.startswith(prefix) for n in names) and any(os.path.exists(f) for f in files)]


def skip_absent_tpu() -> str | None:
  """On a machine without a TPU, names the platforms jax may start (GPUs present, then the CPU), so
  it does not start libtpu (installed with jax[tpu]); returns them, or None when it changed nothing:
  JAX_PLATFORMS set by the user, a TPU here or asked for. Call before jax starts its backends.

  Compiling for a TPU slice without one (`python -m rlver_jax.aot`) loads libtpu by itself, whatever
  the platforms."""
  if "JAX_PLATFORMS" in os.environ or any(k in os.environ for k in _TPU_ENV) or _tpu_visible():
    return None
  platforms = ",".join(_gpu_platforms() + ["cpu"])
  os.environ["JAX_PLATFORMS"] = platforms  # read by jax at import, and by child processes
  jax = sys.modules.get("jax")
  if jax is not None:  # already imported: its config read the variable before it was set
    jax.config.update("jax_platforms", platforms)
  return platforms
