"""The CURVE keys of a deployment's worker plane (defined in `engine.data.curve`).

* `PlaneKeys` -- one deployment's keys: those of its plane and of each side; a worker reads them
  from the folder `PlaneKeys.write` makes;
* `PlaneKeyError` -- keys that cannot be used: missing, malformed, or readable by others;
* `BulkMode` -- how bulk tensor bytes cross hosts on the worker plane.

Light on purpose: the studio's settings import it before any other part of the engine loads.
"""

from __future__ import annotations

from engine.data.curve import BulkMode, PlaneKeyError, PlaneKeys

__all__ = ["BulkMode", "PlaneKeyError", "PlaneKeys"]
